"""Every dashboard query against raypaged's real /metrics: a real `raypaged serve` (one small
worker, real model), scraped by a real Prometheus started with deploy/prometheus.yml, queried
through its HTTP API; the same queries through `promtool test rules` over the exposition; and
the chart's `helm test` script run against the same server."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from deploy_tools import CHART, load_definition, run
from promtool_rules import rules_and_tests
from served import prometheus, raypaged_serve

# Grafana's "All" for the model picker (allValue).
QUERIES = [q.replace("$model_name", ".*") for q in load_definition().queries()]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory, default_model_dir):
    """(raypaged URL, Prometheus URL, what was sent), once the sent requests are scraped."""
    tmp = tmp_path_factory.mktemp("deploy-stack")
    with raypaged_serve(tmp) as url, prometheus(tmp, url.removeprefix("http://")) as prom:
        wait_for(prom, "up{job=\"raypaged\"}", 1)  # a scrape before the requests: rates need two
        sent = send_requests(url)
        wait_for(prom, "sum(raypaged:generation_tokens_total)", sent["generation_tokens"])
        time.sleep(3)  # a few more scrapes, so every rate() window holds an increase
        yield url, prom, sent


def send_requests(url: str) -> dict:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    prompt_tokens = 0
    for i in range(3):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": f"Count to {i + 3}:", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
    bad = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi",
                                                     "max_tokens": -1})
    assert bad.status_code == 400
    return {"requests": 3, "prompt_tokens": prompt_tokens, "generation_tokens": 3 * MAX_TOKENS,
            "errors_400": 1}


def query(prom: str, expr: str) -> list[dict]:
    body = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(prom: str, expr: str) -> float:
    (sample,) = query(prom, expr)
    return float(sample["value"][1])


def wait_for(prom: str, expr: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = query(prom, expr)
        if result and float(result[0]["value"][1]) == value:
            return
        time.sleep(0.5)
    raise AssertionError(f"{expr} never reached {value}: {query(prom, expr)}")


def test_every_dashboard_query_returns_data(stack):
    _, prom, _ = stack
    empty = [q for q in QUERIES if not query(prom, q)]
    assert empty == []


def grouped(expr: str) -> list[tuple[tuple[str, ...], str]]:
    """Each `<op> by (labels) (inner)` in a query: its labels and that aggregation alone."""
    found = []
    for m in re.finditer(r"\b(sum|avg|max|min|count) by \(([^)]*)\) \(", expr):
        depth, end = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            end += 1
        found.append((tuple(label.strip() for label in m.group(2).split(",")), expr[m.start():end]))
    return found


def series_missing_labels(prom: str, expr: str) -> list[str]:
    """'<aggregation>: <series>' for each series that lacks one of the labels it is grouped by:
    a label the metric does not have still returns data, one series with the label empty."""
    return [f"{inner}: {sample['metric']}" for labels, inner in grouped(expr)
            for sample in query(prom, inner) if not all(sample["metric"].get(l) for l in labels)]


def test_every_dashboard_grouping_names_a_label_the_metric_has(stack):
    _, prom, _ = stack
    assert sum(len(grouped(q)) for q in QUERIES) >= 10  # the dashboard's groupings are all seen
    assert [m for q in QUERIES for m in series_missing_labels(prom, q)] == []
    # The check fails a grouping by a label the metric does not carry (a typo of `state`).
    assert series_missing_labels(prom, 'sum by (stat) (raypaged:kv_cache_blocks)') != []


def test_counters_agree_with_what_was_sent(stack):
    _, prom, sent = stack
    assert scalar(prom, "sum(raypaged:prompt_tokens_total)") == sent["prompt_tokens"]
    assert scalar(prom, "sum(raypaged:generation_tokens_total)") == sent["generation_tokens"]
    assert scalar(prom, 'sum(raypaged:request_success_total{finished_reason="length"})') == sent["requests"]
    assert scalar(prom, 'sum(raypaged:request_errors_total{status="400"})') == sent["errors_400"]
    assert scalar(prom, "sum(raypaged:e2e_request_latency_seconds_count)") == sent["requests"]
    assert scalar(prom, "sum(raypaged:prefix_cache_queries_total)") == sent["prompt_tokens"]


def test_fleet_numbers_are_counted_once(stack):
    # One scrape target serves the whole fleet: the dashboard's sums see one worker, not one per pod.
    _, prom, _ = stack
    assert scalar(prom, 'sum(raypaged:worker_up{model_name=~".*"})') == 1
    assert scalar(prom, 'count(raypaged:worker_up{model_name=~".*"})') == 1
    assert scalar(prom, "sum(raypaged:kv_cache_budget_bytes)") == 16 * 2**20


def test_dashboard_queries_pass_promtool_rule_tests_over_the_real_exposition(stack, tmp_path):
    url, _, _ = stack
    exposition = httpx.get(f"{url}/metrics").text
    exact = {'sum(raypaged:worker_up{model_name=~".*"})': 1,
             'sum(raypaged:kv_cache_budget_bytes{model_name=~".*"})': 16 * 2**20}
    rules, tests = rules_and_tests(QUERIES, exposition, exact)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    out = run("promtool", "test", "rules", "tests.yml", cwd=tmp_path)
    assert "SUCCESS" in out.stdout + out.stderr
    # The same harness fails a query that has no data, and a wrong exact value.
    rules, tests = rules_and_tests(["sum(raypaged:no_such_metric)"], exposition,
                                   {'sum(raypaged:worker_up{model_name=~".*"})': 2})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    out = run("promtool", "test", "rules", "tests.yml", cwd=tmp_path, check=False)
    assert out.returncode != 0
    assert "DashboardQuery0HasNoData" in out.stdout + out.stderr
    assert "sum(raypaged:worker_up" in out.stdout + out.stderr


def test_the_charts_helm_test_passes_against_a_running_raypaged(stack, tmp_path):
    # Last in this module: its completion changes the counters the tests above compare.
    url, _, _ = stack
    out = run("helm", "template", "rel", str(CHART), "--show-only", "templates/tests/test-api.yaml",
              "--set", "raypaged.workers=1,metrics.serviceMonitor.enabled=true").stdout
    script = yaml.safe_load(out)["spec"]["containers"][0]["args"][0]
    host = url.removeprefix("http://")
    script = script.replace("rel-raypaged-serve-svc:8000", host).replace("rel-raypaged-metrics:8000", host)
    (tmp_path / "helm_test.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "helm_test.py")], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: ")
