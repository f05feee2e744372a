"""helm/raypaged: `helm lint --strict` and `helm template` with the real helm, for every value set
in tests/deploy/values, and every rendered object validated strictly against the schema the API
server would use (KubeRay's RayService CRD, prometheus-operator's CRDs, core kinds)."""
from __future__ import annotations

import json

import pytest
import yaml

from deploy_tools import CHART, ROOT, VALUES, run
from k8s_schema import validate
from raypaged.serve.config import ServeArgs
from rendered import VALUE_SETS, by_kind, containers, render, render_set, serve_app


def test_the_value_sets_cover_what_operators_deploy():
    assert VALUE_SETS == ["api-key", "autoscaling", "cpu-only", "defaults", "existing-secret",
                          "exposed", "gpu", "monitoring"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_strict_passes(values):
    run("helm", "lint", "--strict", str(CHART), "-f", str(VALUES / f"{values}.yaml"))


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_rendered_object_is_valid_against_its_schema(values):
    docs = render_set(values) + render("-f", str(VALUES / f"{values}.yaml"), "--show-only",
                                       "templates/tests/test-api.yaml")
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_serve_config_is_valid_for_ray_serve_and_raypaged(values):
    from ray.serve.schema import ServeDeploySchema

    (rs,) = by_kind(render_set(values))["RayService"]
    ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    app = serve_app(rs)
    assert app["import_path"] == "raypaged.serve.app:build_app"
    options, _ = ServeArgs(**app["args"]).split()  # unknown keys or bad values raise here
    assert options.app_name == app["name"]


def test_autoscaling_values_turn_on_kuberay_autoscaling_and_the_controllers_bounds():
    (rs,) = by_kind(render_set("autoscaling"))["RayService"]
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    assert cluster["autoscalerOptions"]["securityContext"]["readOnlyRootFilesystem"] is True
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 4)
    options, _ = ServeArgs(**serve_app(rs)["args"]).split()
    assert options.worker_bounds == (1, 4) and options.autoscaling
    (fixed,) = by_kind(render_set("defaults"))["RayService"]
    assert "enableInTreeAutoscaling" not in fixed["spec"]["rayClusterConfig"]


def test_without_an_api_key_only_ray_auth_is_in_the_env():
    (rs,) = by_kind(render_set("defaults"))["RayService"]
    assert all(c["env"] == [{"name": "RAY_AUTH_MODE", "value": "token"}] for c in containers(rs))


@pytest.mark.parametrize("values, secret", [("api-key", "rel-raypaged-api-key"),
                                            ("existing-secret", "raypaged-key")])
def test_every_ray_container_gets_the_api_key_from_its_secret(values, secret):
    kinds = by_kind(render_set(values))
    env = [{"name": "RAY_AUTH_MODE", "value": "token"},
           {"name": "RAYPAGED_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": secret, "key": "api-key"}}}]
    assert [c["env"] for c in containers(kinds["RayService"][0])] == [env, env]
    assert [s["metadata"]["name"] for s in kinds.get("Secret", [])] == (
        [secret] if values == "api-key" else [])


def test_defaults_run_on_the_cpu_image_with_explicit_resources():
    (rs,) = by_kind(render_set("defaults"))["RayService"]
    args = serve_app(rs)["args"]
    assert (args["workers"], args["cpus_per_worker"], args["gpus_per_worker"]) == (2, 4, 0)
    assert "kv_memory_fraction" not in args and args["kv_memory_mb"] == 2048
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["rayStartParams"] == {"num-cpus": "4", "num-gpus": "0",
                                       "metrics-export-port": "8080"}
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "4", "memory": "16Gi"},
                         "limits": {"cpu": "4", "memory": "16Gi"}}


def test_gpu_values_give_each_engine_worker_a_gpu_and_mount_the_model_claim():
    (rs,) = by_kind(render_set("gpu"))["RayService"]
    args = serve_app(rs)["args"]
    assert (args["gpus_per_worker"], args["kv_memory_fraction"]) == (1, 0.9)
    assert "kv_memory_mb" not in args
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert group["rayStartParams"]["num-gpus"] == "1"
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "llm-models", "readOnly": True}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    for c in containers(rs):
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_cpu_only_values_mount_the_model_host_path():
    (rs,) = by_kind(render_set("cpu-only"))["RayService"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "models", "hostPath": {"path": "/srv/models", "type": "Directory"}} in head["volumes"]


def test_pods_run_unprivileged_with_probes_shm_and_ray_metrics_port():
    (rs,) = by_kind(render_set("defaults"))["RayService"]
    cluster = rs["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]]:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["spec"]["containers"]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        assert "readinessProbe" in c and "livenessProbe" in c
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"containerPort": 8080, "name": "ray-metrics"} in c["ports"]
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"


def test_the_service_monitor_scrapes_raypaged_metrics_on_the_head_only():
    # Every router replica renders the whole fleet: scraping every pod multiplied every number.
    kinds = by_kind(render_set("monitoring"))
    (monitor,) = kinds["ServiceMonitor"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    selected = [s for s in services.values() if all(
        s["metadata"]["labels"].get(k) == v
        for k, v in monitor["spec"]["selector"]["matchLabels"].items())]
    assert [s["metadata"]["name"] for s in selected] == ["rel-raypaged-metrics"]
    (rs,) = kinds["RayService"]
    cluster = rs["spec"]["rayClusterConfig"]
    pod_labels = {"head": cluster["headGroupSpec"]["template"]["metadata"]["labels"],
                  "worker": cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"]}
    selector = selected[0]["spec"]["selector"]
    matched = [role for role, labels in pod_labels.items()
               if all(labels.get(k) == v for k, v in selector.items())]
    assert matched == ["head"]
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "15s"}]
    (pod_monitor,) = kinds["PodMonitor"]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "ray-metrics"


def test_the_dashboard_config_map_holds_the_dashboard_for_the_sidecar():
    (cm,) = by_kind(render_set("monitoring"))["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    committed = json.loads((ROOT / "deploy/grafana/raypaged.json").read_text())
    assert json.loads(cm["data"]["raypaged.json"]) == committed


def test_helm_test_pod_checks_health_models_a_completion_and_metrics():
    (pod,) = render("-f", str(VALUES / "monitoring.yaml"), "--show-only",
                    "templates/tests/test-api.yaml")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    compile(script, "test-api", "exec")  # the script the pod runs is valid Python
    for needle in ("/health", "/v1/models", "/v1/completions", "rel-raypaged-metrics:8000/metrics",
                   "len(up) == 2"):
        assert needle in script


@pytest.mark.parametrize("overrides, message", [
    (["--set", "workers.replicas=3"],
     "workers.replicas=3 must lie within workers.minReplicas=2 and workers.maxReplicas=2"),
    (["--set", "raypaged.workers=3"], "raypaged.workers=3 engine workers need 4 CPU"),
    (["--set", "raypaged.gpus_per_worker=1"], "raypaged.workers=2 engine workers need 4 CPU and 1 GPU"),
    (["--set", "raypaged.max_workers=3"], "raypaged.max_workers=3 engine workers need 4 CPU and 0 "
     "GPU each, but 2 worker pods (workers.replicas: autoscaling.enabled=false adds no pods)"),
    (["--set", "raypaged.max_workers=5,autoscaling.enabled=true,workers.maxReplicas=4"],
     "raypaged.max_workers=5 engine workers need 4 CPU and 0 GPU each, but 4 worker pods "
     "(workers.maxReplicas)"),
    (["--set", "raypaged.kv_memory_fraction=0.9"], "on CPU set raypaged.kv_memory_mb instead"),
    (["--set", "model.hostPath=/m,model.persistentVolumeClaim=c"],
     "set one of model.persistentVolumeClaim and model.hostPath"),
    (["--set", "workers.cpus=0"], "at '/workers/cpus': minimum"),
    (["--set", "workers.replicaz=2"], "additional properties 'replicaz' not allowed"),
    (["--set", "raypaged.workers=0"], "at '/raypaged/workers': minimum"),
])
def test_values_that_cannot_work_are_refused_with_the_fix(overrides, message):
    done = run("helm", "template", "rel", str(CHART), *overrides, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
