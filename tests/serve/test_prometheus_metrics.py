"""/metrics parses with prometheus-client's own parser, and its counters match what was sent."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(app) -> dict[tuple, float]:
    """(sample name, sorted labels without model_name) -> value."""
    r = httpx.get(f"{app.url}/metrics")  # open even with an API key
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def delta(after, before, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def test_request_counters_match_what_was_sent(app, client, model_name):
    before = scrape(app)
    prompt_tokens = 0
    for i in range(3):
        r = client.completions.create(model=model_name, prompt=f"Count to {i + 3}:", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
        prompt_tokens += r.usage.prompt_tokens
    stream = client.chat.completions.create(model=model_name, max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "Hi"}],
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][0]
    prompt_tokens += usage.prompt_tokens
    httpx.post(f"{app.url}/v1/completions", headers=app.headers,
               json={"model": model_name, "prompt": "hi", "max_tokens": -1})
    after = scrape(app)

    assert delta(after, before, "raypaged:generation_tokens_total") == 3 * 5 + 4
    assert delta(after, before, "raypaged:prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "raypaged:request_success_total", finished_reason="length") == 4
    assert delta(after, before, "raypaged:request_errors_total", status="400") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "time_per_output_token_seconds"):
        assert delta(after, before, f"raypaged:{hist}_count") == 4
    assert delta(after, before, "raypaged:inter_token_latency_seconds_count") == 3 * 4 + 3
    routed = sum(delta(after, before, "raypaged:routing_decisions_total", reason=r)
                 for r in ("affinity", "load_bound", "round_robin", "cache_hit", "cold_prefix"))
    assert routed == 4


def test_fleet_view_is_labelled_by_worker(app, client, model_name):
    client.completions.create(model=model_name, prompt="Warm the prefix cache, please.",
                              max_tokens=1)
    time.sleep(1.0)  # one controller poll and one router refresh
    m = scrape(app)
    for worker in ("worker-0", "worker-1"):
        w = (("worker", worker),)
        assert m[("raypaged:worker_up", w)] == 1
        assert 0 <= m[("raypaged:kv_cache_usage_perc", w)] <= 1
        assert m[("raypaged:kv_cache_budget_bytes", w)] == 64 * 1024 * 1024
        assert m[("raypaged:kv_cache_max_concurrency", w)] >= 1
        assert m[("raypaged:kv_cache_max_tokens", w)] >= 1024
        blocks = {s: m[("raypaged:kv_cache_blocks", (("state", s), ("worker", worker)))]
                  for s in ("used", "cached", "free")}
        assert sum(blocks.values()) * m[("raypaged:kv_cache_bytes_per_token", w)] * 16 <= 64 * 2**20
        hits, queries = (m[(f"raypaged:prefix_cache_{k}_total", w)] for k in ("hits", "queries"))
        assert hits <= queries
        for name in ("num_requests_running", "num_requests_waiting"):
            assert (f"raypaged:{name}", w) in m
        assert ("raypaged:num_preemptions_total", w) in m
    assert sum(v for (name, _), v in m.items() if name == "raypaged:prefix_cache_queries_total") > 0


def test_fleet_json_sums_the_workers(app):
    fleet = app.fleet()
    total = fleet["total"]
    assert total["workers_ready"] == 2
    assert total["num_blocks"] == sum(w["budget"]["num_blocks"] for w in fleet["workers"])
    assert total["kv_budget_bytes"] == 2 * 64 * 1024 * 1024
    assert total["max_seqs_at_max_model_len"] >= 2
