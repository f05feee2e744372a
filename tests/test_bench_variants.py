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
        ["ingress", "ingress", "ingress", "router", "worker", "raylet"]


def test_rays_python_daemons_are_told_apart_by_their_command_line():
    py = "/venv/bin/python -u /venv/lib/python3.11/site-packages/ray/"
    assert role("python", py + "_private/log_monitor.py --session-dir=/tmp/x") == "log_monitor"
    assert role("python", py + "dashboard/dashboard.py --host=127.0.0.1") == "dashboard"
    assert role("python", py + "autoscaler/_private/monitor.py --logs-dir=x") == \
        "autoscaler_monitor"
    assert role("ray::DashboardA") == "dashboard"
    assert role("python", "/usr/bin/python something_else.py") == "ray_other"


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


def test_vs_vllm_reads_workloads_and_compares_each_workload_with_itself():
    import argparse

    import pytest

    from benchmarks.vs_vllm import medians, parse_workloads, ratios

    assert parse_workloads("256x64,1024x128") == [(256, 64), (1024, 128)]
    with pytest.raises(argparse.ArgumentTypeError, match="expected INPUTxOUTPUT"):
        parse_workloads("256/64")

    def run(server, w, k, tok_s):
        return {"server": server, "workload": w, "round": k, "concurrency": 16, "prompts": 64,
                "load_avg_1m": 2.0 + k, "output_throughput": tok_s, "mean_ttft_ms": 100.0,
                "p99_ttft_ms": 200.0, "mean_tpot_ms": 10.0, "p99_tpot_ms": 20.0}
    runs = [run("vllm", "256x64", 0, 100.0), run("vllm", "256x64", 1, 80.0),
            run("raypaged", "256x64", 0, 120.0), run("raypaged", "256x64", 1, 90.0),
            run("vllm", "1024x128", 0, 50.0), run("raypaged", "1024x128", 0, 40.0)]
    rows = {(r["server"], r["workload"]): r for r in medians(runs)}
    assert rows[("raypaged", "256x64")]["output_throughput"] == 105.0  # median of the rounds
    assert rows[("raypaged", "256x64")]["rounds"] == 2
    assert rows[("raypaged", "256x64")]["load_avg_1m"] == 2.5
    out = {r["workload"]: r for r in ratios(list(rows.values()))}
    assert out["256x64"]["output_throughput_ratio"] == 105.0 / 90.0
    assert out["1024x128"]["output_throughput_ratio"] == 0.8


def test_the_workers_cpu_splits_into_step_thread_openmp_pool_and_the_rest():
    from benchmarks.serve_cpu import worker_threads_split
    before = {1: ("ray::WorkerActo", 1.0), 2: ("rp-step", 10.0), 3: ("rp-step", 2.0)}
    after = {1: ("ray::WorkerActo", 1.5), 2: ("rp-step", 14.0), 3: ("rp-step", 3.0),
             4: ("ray::IDLE", 0.25)}  # a thread started during the run counts from zero
    assert worker_threads_split(before, after) == \
        {"step_thread": 4.0, "omp_pool": 1.0, "rest": 0.75}


def test_vs_vllm_gives_every_cell_its_own_prompts_the_same_for_every_server(monkeypatch, tmp_path):
    """One seed for all cells re-sent the earlier cells' prompts, which then hit the prefix cache."""
    import argparse

    from benchmarks import vs_vllm

    seen = []

    def client(python, url, model_dir, c, n, shape):
        seen.append((shape.input_len, c, shape.seed))
        return {m: 1.0 for m in vs_vllm.METRICS}
    monkeypatch.setattr(vs_vllm, "run_client", client)
    monkeypatch.setattr(vs_vllm, "stop", lambda proc: None)
    args = argparse.Namespace(workloads=[(256, 64), (1024, 128)], concurrency=[1, 4],
                              prompts_per_client=2, seed=5)
    for server in ("raypaged", "vllm"):
        vs_vllm.bench_server(server, lambda log: (None, "http://x"), "py", "model", args, tmp_path)
    cells = [(256, 1, 6), (256, 4, 9), (1024, 1, 1006), (1024, 4, 1009)]
    assert seen == cells * 2
