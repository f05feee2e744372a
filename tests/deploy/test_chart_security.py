"""helm/raypaged locks its Ray cluster: Ray's token auth on every Ray container, a NetworkPolicy
that lets only the release's Ray pods reach Ray's ports, only the serve port on the Services,
no service-account token, a read-only root filesystem, and refusals for an exposed API without
a key or a key in plaintext. Rendered by the real helm for every value set."""
from __future__ import annotations

import pytest

from deploy_tools import CHART, run
from rendered import VALUE_SETS, by_kind, containers, pod_templates, render, render_set

TOKEN_MODE = {"name": "RAY_AUTH_MODE", "value": "token"}
TEST_POD = "templates/tests/test-api.yaml"


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector, evaluated (matchLabels and the In/NotIn/Exists operators)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []),
              "NotIn": not present or value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def open_to(policy: dict, port: int, peer: dict) -> bool:
    """Whether the policy admits `peer` (a pod: {"labels", "namespace_labels"}) on `port`."""
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports is not None and all(p["port"] != port for p in ports):
            continue
        sources = rule.get("from")
        if sources is None:  # no `from`: every peer
            return True
        for s in sources:
            if "ipBlock" in s:
                continue
            pod_ok = "podSelector" not in s or selects(s["podSelector"], peer["labels"])
            if "namespaceSelector" in s:  # any namespace the selector matches
                ns_ok = selects(s["namespaceSelector"], peer["namespace_labels"])
            else:  # the policy's own namespace only
                ns_ok = peer["namespace_labels"].get("kubernetes.io/metadata.name") == "llm"
            if pod_ok and ns_ok:
                return True
    return False


def pod(labels: dict, namespace: str = "llm") -> dict:
    return {"labels": labels, "namespace_labels": {"kubernetes.io/metadata.name": namespace}}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_ray_container_runs_with_ray_token_auth(values):
    (rs,) = by_kind(render_set(values))["RayService"]
    auth = rs["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == ({"mode": "token", "secretName": "ray-token"} if values == "exposed"
                    else {"mode": "token"})
    for c in containers(rs):
        assert TOKEN_MODE in c["env"], c["name"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_network_policy_admits_only_the_release_on_ray_ports(values):
    kinds = by_kind(render_set(values))  # helm template renders the test hook too
    (policy,) = kinds["NetworkPolicy"]
    (rs,) = kinds["RayService"]
    ray_pods = {role: t["metadata"]["labels"] for role, t in pod_templates(rs).items()}
    (test_pod,) = kinds["Pod"]
    # It guards every pod of the release, the helm test pod included.
    for labels in [*ray_pods.values(), test_pod["metadata"]["labels"]]:
        assert selects(policy["spec"]["podSelector"], labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]

    head_ports = {p["name"]: p["containerPort"]
                  for p in rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
                  ["containers"][0]["ports"]}
    ray_ports = [6379, 8265, 10001, 52365, 8076, 20000]  # GCS, dashboard, client, agent, ...
    stranger = pod({"app": "anything"})
    other_release = pod({**ray_pods["head"], "app.kubernetes.io/instance": "other"})
    operator = pod({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system")
    for port in ray_ports:
        for labels in ray_pods.values():  # head <-> workers: every port
            assert open_to(policy, port, pod(labels))
        assert not open_to(policy, port, pod(test_pod["metadata"]["labels"])), port
        assert not open_to(policy, port, other_release), port
        assert open_to(policy, port, stranger) is False, port
        assert open_to(policy, port, operator) is (port == 8265), port
    serve = head_ports["serve"]
    assert open_to(policy, serve, pod(test_pod["metadata"]["labels"]))  # `helm test` works
    assert open_to(policy, serve, operator)  # KubeRay checks the head's Serve proxy there
    if values == "exposed":  # the ingress controller's namespace and one network only
        assert not open_to(policy, serve, stranger)
        assert open_to(policy, serve, pod({"x": "y"}, "ingress-nginx"))
        assert not open_to(policy, 8265, pod({"app.kubernetes.io/name": "kuberay-operator"},
                                             "elsewhere"))
    else:
        assert open_to(policy, serve, stranger)
    metrics = head_ports["ray-metrics"]
    assert open_to(policy, metrics, stranger) is (values == "monitoring"), values


def test_the_network_policy_can_be_turned_off():
    kinds = by_kind(render("--set", "networkPolicy.enabled=false"))
    assert "NetworkPolicy" not in kinds


@pytest.mark.parametrize("values", VALUE_SETS)
def test_only_the_serve_port_is_on_the_services(values):
    kinds = by_kind(render_set(values))
    (rs,) = kinds["RayService"]
    assert [p["name"] for p in rs["spec"]["serveService"]["spec"]["ports"]] == ["serve"]
    # KubeRay copies the head container's named ports onto the head Service: GCS (workers join
    # through it) and dashboard (the operator deploys through it) must stay; the Ray client port
    # is not published.
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert sorted(p["name"] for p in head["ports"]) == ["dashboard", "gcs-server", "ray-metrics",
                                                        "serve"]
    for service in kinds.get("Service", []):  # the chart's own: the head-only metrics Service
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["serve"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_pods_mount_no_token_and_write_only_to_their_empty_dirs(values):
    (rs,) = by_kind(render_set(values))["RayService"]
    (test_pod,) = render_set(values, "--show-only", TEST_POD)
    for spec in [t["spec"] for t in pod_templates(rs).values()] + [test_pod["spec"]]:
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
    for template in pod_templates(rs).values():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (c,) = template["spec"]["containers"]
        writable = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]
                    if not m.get("readOnly")}
        assert set(writable) == {"/dev/shm", "/tmp", "/home/ray/.cache", "/home/ray/.triton"}
        assert all("emptyDir" in v for v in writable.values())


def test_an_api_key_given_as_a_value_is_only_in_its_secret():
    docs = render_set("api-key")
    holders = [d["kind"] for d in docs if "s3cret" in str(d)]
    assert holders == ["Secret"]


def test_an_exposed_api_with_a_key_renders():
    kinds = by_kind(render_set("exposed"))
    (rs,) = kinds["RayService"]
    assert rs["spec"]["serveService"]["spec"]["type"] == "LoadBalancer"
    (ingress,) = kinds["Ingress"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rel-raypaged-serve-svc", "port": {"number": 8000}}
    assert ingress["spec"]["tls"] == [{"hosts": ["llm.example.com"],
                                       "secretName": "llm-example-com-tls"}]


EXPOSED_WITHOUT_KEY = "publishes the API beyond the cluster, but no API key is set"


@pytest.mark.parametrize("overrides, message", [
    (["--set", "service.type=LoadBalancer"], "service.type=LoadBalancer " + EXPOSED_WITHOUT_KEY),
    (["--set", "service.type=NodePort"], "service.type=NodePort " + EXPOSED_WITHOUT_KEY),
    (["--set", "ingress.enabled=true"],
     "service.type=ClusterIP with ingress.enabled=true " + EXPOSED_WITHOUT_KEY),
    (["--set", "raypaged.api_key=s3cret"], "raypaged.api_key would be written in plaintext"),
    (["--set", "raypaged.api_key=s3cret,apiKey.value=s3cret"],
     "raypaged.api_key would be written in plaintext"),
    (["--set-json", "networkPolicy.operator=[]"], "at '/networkPolicy/operator'"),
    (["--set-json", "networkPolicy.metricsFrom=[]"], "at '/networkPolicy/metricsFrom'"),
])
def test_an_open_api_or_a_plaintext_key_is_refused_with_the_fix(overrides, message):
    done = run("helm", "template", "rel", str(CHART), *overrides, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    if "API key is set" in message:
        assert "Set apiKey.existingSecret" in done.stderr
    if "plaintext" in message:
        assert "s3cret" not in done.stderr
