"""Validate rendered manifests as `kubectl apply --validate=strict` would, without a cluster.

A CRD's openAPIV3Schema is a Kubernetes *structural* schema: the API server prunes fields it
does not declare (silently dropping a mistyped key), and kubectl's strict validation refuses
them. Here that becomes JSON Schema: every object that lists `properties` gets
`additionalProperties: false` unless it says `x-kubernetes-preserve-unknown-fields`, and
`x-kubernetes-int-or-string` becomes "integer or string". Built-in kinds (Service, Pod) are
checked with the schemas KubeRay's CRD embeds for them (its serveService is a whole Service,
its pod templates whole PodTemplateSpecs, generated from the Kubernetes API types).
"""
from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import jsonschema

CRDS = Path(__file__).resolve().parent / "crds"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def strict(node):
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable"):
        out = {"anyOf": [{"type": "null"}, {k: v for k, v in out.items() if k != "nullable"}]}
    elif "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd(name: str) -> dict:
    """A vendored CRD: {"source", "apiVersion", "kind", "schema"} (see crds/vendor_crd.py)."""
    return json.loads((CRDS / f"{name}.json").read_text())


METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
CONFIG_MAP = {  # core/v1 ConfigMap and Secret: small enough to state here
    "type": "object", "additionalProperties": False, "required": ["data"],
    "properties": {"apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"},
                   "metadata": METADATA, "data": {"type": "object",
                                                  "additionalProperties": {"type": "string"}}},
}
SECRET = {
    "type": "object", "additionalProperties": False, "required": ["stringData"],
    "properties": {"apiVersion": {"const": "v1"}, "kind": {"const": "Secret"},
                   "metadata": METADATA, "type": {"const": "Opaque"},
                   "stringData": {"type": "object", "additionalProperties": {"type": "string"}}},
}


@cache
def _schemas() -> dict[tuple[str, str], dict]:
    schemas = {}
    for name in ("rayservice", "servicemonitor", "podmonitor"):
        vendored = crd(name)
        schema = strict(vendored["schema"])
        schema["properties"]["metadata"] = METADATA
        schemas[(vendored["apiVersion"], vendored["kind"])] = schema
    ray_spec = crd("rayservice")["schema"]["properties"]["spec"]["properties"]
    service = strict(ray_spec["serveService"])
    service["properties"]["metadata"] = METADATA
    pod_template = ray_spec["rayClusterConfig"]["properties"]["headGroupSpec"]["properties"]["template"]
    pod = strict(pod_template)
    pod["properties"].update(apiVersion={"const": "v1"}, kind={"const": "Pod"}, metadata=METADATA)
    schemas[("v1", "Service")] = service
    schemas[("v1", "Pod")] = pod
    schemas[("v1", "ConfigMap")] = CONFIG_MAP
    schemas[("v1", "Secret")] = SECRET
    return schemas


def validate(manifest: dict) -> None:
    """Raise jsonschema.ValidationError (with the path of the bad field) if the manifest would be
    refused or pruned by the API server."""
    key = (manifest.get("apiVersion"), manifest.get("kind"))
    schemas = _schemas()
    if key not in schemas:
        raise AssertionError(f"no schema for {key}: vendor one under tests/deploy/crds")
    jsonschema.Draft7Validator(schemas[key]).validate(manifest)
    # Names of objects that are not Services may be DNS subdomains (longer, with dots).
    assert re.match(DNS_SUBDOMAIN, manifest["metadata"]["name"])
