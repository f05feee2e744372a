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
        "namespace": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL},
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

# networking.k8s.io/v1 NetworkPolicy and Ingress, the fields of the API types (k8s.io/api
# networking/v1 types.go), stated here: no vendored CRD embeds them.
_OBJ = {"type": "object"}
_STR = {"type": "string"}
_PORT = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535}, _STR]}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": _STR},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["key", "operator"],
        "properties": {"key": _STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": _STR}}}}}}
_PEER = {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
    "podSelector": _SELECTOR, "namespaceSelector": _SELECTOR,
    "ipBlock": {"type": "object", "additionalProperties": False, "required": ["cidr"],
                "properties": {"cidr": _STR, "except": {"type": "array", "items": _STR}}}}}
_NP_PORT = {"type": "object", "additionalProperties": False, "properties": {
    "port": _PORT, "endPort": {"type": "integer"}, "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}
NETWORK_POLICY = {
    "type": "object", "additionalProperties": False, "required": ["spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "NetworkPolicy"},
        "metadata": METADATA,
        "spec": {"type": "object", "additionalProperties": False, "required": ["podSelector"],
                 "properties": {
                     "podSelector": _SELECTOR,
                     "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                     "ingress": {"type": "array", "items": {
                         "type": "object", "additionalProperties": False, "properties": {
                             "from": {"type": "array", "items": _PEER},
                             "ports": {"type": "array", "items": _NP_PORT}}}},
                     "egress": {"type": "array", "items": {
                         "type": "object", "additionalProperties": False, "properties": {
                             "to": {"type": "array", "items": _PEER},
                             "ports": {"type": "array", "items": _NP_PORT}}}}}}},
}
_BACKEND = {"type": "object", "additionalProperties": False, "properties": {
    "service": {"type": "object", "additionalProperties": False, "required": ["name", "port"],
                "properties": {"name": _STR, "port": {
                    "type": "object", "additionalProperties": False, "minProperties": 1,
                    "maxProperties": 1, "properties": {"name": _STR, "number": _PORT}}}},
    "resource": _OBJ}}
INGRESS = {
    "type": "object", "additionalProperties": False, "required": ["spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "Ingress"},
        "metadata": METADATA,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "ingressClassName": _STR, "defaultBackend": _BACKEND,
            "tls": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "hosts": {"type": "array", "items": _STR}, "secretName": _STR}}},
            "rules": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "host": _STR,
                    "http": {"type": "object", "additionalProperties": False, "required": ["paths"],
                             "properties": {"paths": {"type": "array", "items": {
                                 "type": "object", "additionalProperties": False,
                                 "required": ["pathType", "backend"],
                                 "properties": {"path": _STR, "backend": _BACKEND,
                                                "pathType": {"enum": ["Exact", "Prefix",
                                                                      "ImplementationSpecific"]}}}}}}}}}}},
    },
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
    schemas[("networking.k8s.io/v1", "NetworkPolicy")] = NETWORK_POLICY
    schemas[("networking.k8s.io/v1", "Ingress")] = INGRESS
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
