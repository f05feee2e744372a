"""How the serving benchmarks read a variant (benchmarks/serve_process.py split_env) and compare
variants (benchmarks/serve_cpu.py summarize): a wrong split would benchmark Ray Serve's switches
as unknown CLI flags, or a flag as an environment variable, and report the wrong server."""
from benchmarks.serve_cpu import role, summarize
from benchmarks.serve_process import split_env


def test_leading_name_value_words_are_the_environment_and_the_rest_flags():
    env, flags = split_env(["RAY_SERVE_ENABLE_HA_PROXY=1", "RAY_SERVE_THROUGHPUT_OPTIMIZED=1",
                            "--workers", "2", "--served-model-name", "A=B"])
    assert env == {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    assert flags == ["--workers", "2", "--served-model-name", "A=B"]


def test_flags_first_means_no_environment():
    assert split_env(["--enforce-eager", "X=1"]) == ({}, ["--enforce-eager", "X=1"])
    assert split_env(["--decode-threads=2"]) == ({}, ["--decode-threads=2"])
    assert split_env([]) == ({}, [])


def test_haproxy_and_the_python_proxy_both_count_as_the_ingress():
    assert [role(n) for n in ("ray::ProxyActor", "haproxy", "ray::HAProxyMan", "ray::ServeRepli",
                              "ray::WorkerActo", "raylet")] == \
        ["ingress", "ingress", "ingress", "router", "worker", "ray_other"]


def test_summary_takes_the_median_of_rounds_and_ratios_to_default_of_the_same_concurrency():
    def row(variant, c, tok_s, path_ms):
        return {"variant": variant, "concurrency": c, "output_throughput": tok_s,
                "mean_tpot_ms": 10.0, "mean_ttft_ms": 100.0, "serving_path_ms_per_token": path_ms,
                "router_ms_per_token": path_ms, "ingress_ms_per_token": 0.0,
                "worker_ms_per_token": 5.0}
    rows = [row("default", 16, 100.0, 2.0), row("default", 16, 120.0, 4.0),
            row("default", 16, 110.0, 3.0), row("haproxy", 16, 132.0, 1.5),
            row("default", 1, 50.0, 4.0)]
    out = {(s["variant"], s["concurrency"]): s for s in summarize(rows)}
    assert out[("default", 16)]["runs"] == 3
    assert out[("default", 16)]["output_throughput"] == 110.0
    assert out[("haproxy", 16)]["output_throughput_vs_default"] == 1.2
    assert out[("haproxy", 16)]["serving_path_ms_per_token_vs_default"] == 0.5
    assert "output_throughput_vs_default" not in out[("default", 1)]
