"""Vendor a CRD's validation schema: `python vendor_crd.py CRD.yaml SOURCE OUT.json`.

Keeps only what validation needs (the served version's openAPIV3Schema, `description`s removed:
they are most of the bytes) and records where it came from, so the vendored file is small and
can be refreshed from a newer release with one command:

    git show v1.6.2:ray-operator/config/crd/bases/ray.io_rayservices.yaml > /tmp/crd.yaml
    python vendor_crd.py /tmp/crd.yaml "ray-project/kuberay v1.6.2 (598eb66a) ..." rayservice.json
"""
from __future__ import annotations

import json
import sys

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(crd_path: str, source: str, out_path: str) -> None:
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    spec = crd["spec"]
    (version,) = [v for v in spec["versions"] if v.get("storage")]
    vendored = {
        "source": source,
        "apiVersion": f"{spec['group']}/{version['name']}",
        "kind": spec["names"]["kind"],
        "schema": strip(version["schema"]["openAPIV3Schema"]),
    }
    with open(out_path, "w") as f:
        json.dump(vendored, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
