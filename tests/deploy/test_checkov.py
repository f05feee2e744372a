"""checkov's Kubernetes checks over the chart as rendered for every value set: no failed check
outside the allow-list below, each entry saying why it does not apply.

checkov does not look inside custom resources, so a RayService is also handed to it as what
KubeRay makes of it: one Pod per pod template (head, each worker group) and its serve Service.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml

from deploy_tools import run
from rendered import VALUE_SETS, pod_templates, render_set

# check id -> (resources it is allowed on, as a regex over checkov's "Kind.namespace.name", why)
ALLOWED = {
    "CKV_K8S_43": (r"Pod\..*", "Image by digest: the image is the operator's own build of "
                   "deploy/Dockerfile, named by image.repository/tag; a digest can go in the tag"),
    "CKV_K8S_15": (r"Pod\..*", "Pull policy Always: the image holds torch (GBs); IfNotPresent "
                   "with versioned tags is the default, image.pullPolicy changes it"),
    "CKV_K8S_40": (r"Pod\..*", "UID >= 10000: the rayproject/ray base image's user is uid 1000 "
                   "and owns its Python; runAsNonRoot is set, podSecurityContext can change it"),
    "CKV_K8S_35": (r"Pod\..*", "Secret as a file, not env: RAYPAGED_API_KEY is the one way a "
                   "key reaches raypaged (raypaged serve, Serve config files, the Ray job), and "
                   "KubeRay hands Ray its own token (RAY_AUTH_TOKEN) the same way"),
    "CKV_K8S_8": (r"Pod\.llm\.rel-raypaged-test-api", "Liveness probe on the `helm test` pod, "
                  "which runs once to completion and serves nothing"),
    "CKV_K8S_9": (r"Pod\.llm\.rel-raypaged-test-api", "Readiness probe: the same test pod"),
}


def as_checkov_sees_it(docs: list[dict]) -> list[dict]:
    """The rendered objects, each RayService replaced by the Pods and Service KubeRay creates."""
    out = []
    for doc in docs:
        if doc["kind"] != "RayService":
            out.append(doc)
            continue
        meta = doc["metadata"]
        for role, template in pod_templates(doc).items():
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": f"{meta['name']}-{role}", "namespace": meta["namespace"],
                                     "labels": template["metadata"]["labels"]},
                        "spec": template["spec"]})
        serve = doc["spec"]["serveService"]
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {**serve["metadata"], "namespace": meta["namespace"]},
                    "spec": serve["spec"]})
    return out


def failed_checks(manifests: dict[str, list[dict]], tmp_path) -> dict[str, set[tuple[str, str]]]:
    """file stem -> {(check id, resource)} that checkov fails, one checkov run over all files."""
    for stem, docs in manifests.items():
        (tmp_path / f"{stem}.yaml").write_text(yaml.safe_dump_all(docs))
    done = run("checkov", "--directory", str(tmp_path), "--framework", "kubernetes",
               "--output", "json", "--quiet", "--compact", check=False)
    assert done.returncode in (0, 1), done.stderr  # 1: some check failed
    reports = json.loads(done.stdout)
    failed: dict[str, set[tuple[str, str]]] = {stem: set() for stem in manifests}
    for report in reports if isinstance(reports, list) else [reports]:
        for check in report["results"]["failed_checks"]:
            stem = check["file_path"].rsplit("/", 1)[-1].removesuffix(".yaml")
            failed[stem].add((check["check_id"], check["resource"]))
    return failed


def outside_allow_list(found: set[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted((c, r) for c, r in found
                  if c not in ALLOWED or not re.fullmatch(ALLOWED[c][0], r))


@pytest.fixture(scope="module")
def checkov_findings(tmp_path_factory):
    manifests = {name: as_checkov_sees_it(render_set(name)) for name in VALUE_SETS}
    return failed_checks(manifests, tmp_path_factory.mktemp("checkov"))


@pytest.mark.parametrize("values", VALUE_SETS)
def test_checkov_finds_nothing_outside_the_allow_list(checkov_findings, values):
    assert outside_allow_list(checkov_findings[values]) == []
    # checkov did check the Ray pods (the allow-listed findings are there to be found)
    assert ("CKV_K8S_40", "Pod.llm.rel-raypaged-head") in checkov_findings[values]


def test_checkov_catches_what_the_chart_guards_against(tmp_path):
    # The same run, on the chart with its guards turned off, fails the checks they satisfy.
    manifests = {"open": as_checkov_sees_it(render_set(
        "defaults", "--set", "networkPolicy.enabled=false",
        "--set", "securityContext.readOnlyRootFilesystem=false"))}
    found = {c for c, _ in outside_allow_list(failed_checks(manifests, tmp_path)["open"])}
    assert {"CKV2_K8S_6", "CKV_K8S_22"} <= found  # no NetworkPolicy; writable root filesystem
