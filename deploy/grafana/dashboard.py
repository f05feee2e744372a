"""The raypaged Grafana dashboard, defined once here and written as JSON where it is used:

    python deploy/grafana/dashboard.py     # writes deploy/grafana/raypaged.json (file provisioning)
                                           # and helm/raypaged/dashboards/raypaged.json (sidecar)

The datasource is a dashboard variable (`datasource`, any Prometheus), so the JSON loads as it is
through provisioning or the sidecar; `__inputs` would need Grafana's manual import. tests/deploy
checks that both files match this definition, type-checks them against Grafana's own schema
(@grafana/schema), and runs every query against a real Prometheus scraping raypaged.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (ROOT / "deploy/grafana/raypaged.json", ROOT / "helm/raypaged/dashboards/raypaged.json")

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
M = '{model_name=~"$model_name"}'  # every query follows the model picker


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate(raypaged:{metric}_bucket{M}[1m])))",
             f"p{round(q * 100)}") for q in (0.5, 0.99)]


# (panel type, title, unit, [(PromQL, legend)]), laid out in rows: four stats, then pairs.
PANELS = [
    ("stat", "Workers up", "short", [
        (f"sum(raypaged:worker_up{M})", "ready"), (f"count(raypaged:worker_up{M})", "total")]),
    ("stat", "Fleet prefix-cache hit rate (5m)", "percentunit", [
        (f"sum(rate(raypaged:prefix_cache_hits_total{M}[5m])) / "
         f"sum(rate(raypaged:prefix_cache_queries_total{M}[5m]))", "hit rate")]),
    ("stat", "Fleet KV budget", "bytes", [(f"sum(raypaged:kv_cache_budget_bytes{M})", "bytes")]),
    ("stat", "Sequences of max_model_len that fit", "short", [
        (f"sum(raypaged:kv_cache_max_concurrency{M})", "fleet")]),
    ("timeseries", "KV-cache usage by worker", "percentunit", [
        (f"raypaged:kv_cache_usage_perc{M}", "{{worker}}")]),
    ("timeseries", "KV blocks by state", "short", [
        (f"sum by (state) (raypaged:kv_cache_blocks{M})", "{{state}}")]),
    ("timeseries", "Requests running / waiting by worker", "short", [
        (f"raypaged:num_requests_running{M}", "running {{worker}}"),
        (f"raypaged:num_requests_waiting{M}", "waiting {{worker}}")]),
    ("timeseries", "Prefix-cache hit rate by worker (1m)", "percentunit", [
        (f"rate(raypaged:prefix_cache_hits_total{M}[1m]) / "
         f"rate(raypaged:prefix_cache_queries_total{M}[1m])", "{{worker}}")]),
    ("timeseries", "Time to first token", "s", quantiles("time_to_first_token_seconds")),
    ("timeseries", "Time per output token", "s", quantiles("time_per_output_token_seconds")),
    ("timeseries", "End-to-end latency", "s", quantiles("e2e_request_latency_seconds")),
    ("timeseries", "Token throughput", "short", [
        (f"sum(rate(raypaged:prompt_tokens_total{M}[1m]))", "prompt tokens/s"),
        (f"sum(rate(raypaged:generation_tokens_total{M}[1m]))", "generated tokens/s")]),
    ("timeseries", "Finished requests by reason", "reqps", [
        (f"sum by (finished_reason) (rate(raypaged:request_success_total{M}[1m]))",
         "{{finished_reason}}")]),
    ("timeseries", "Routing decisions by reason", "reqps", [
        (f"sum by (reason) (rate(raypaged:routing_decisions_total{M}[1m]))", "{{reason}}")]),
    ("timeseries", "Preemptions, evictions, copy-on-write", "short", [
        (f"sum(rate(raypaged:num_preemptions_total{M}[1m]))", "preemptions/s"),
        (f"sum(rate(raypaged:prefix_cache_evictions_total{M}[1m]))", "evictions/s"),
        (f"sum(rate(raypaged:kv_cache_cow_copies_total{M}[1m]))", "CoW copies/s")]),
    ("timeseries", "Workers: desired vs serving (autoscaler)", "short", [
        ('raypaged:autoscaler_workers{model_name=~"$model_name",'
         'state=~"desired|serving|starting|draining"}', "{{state}}")]),
    ("timeseries", "Autoscaler: predicted queue wait, decisions, drain time", "short", [
        (f"max(raypaged:autoscaler_predicted_wait_seconds{M})", "predicted wait (s)"),
        (f"sum by (direction, reason) (increase(raypaged:autoscaler_decisions_total{M}[5m]))",
         "{{direction}}: {{reason}} (5m)"),
        (f"sum(increase(raypaged:autoscaler_drain_seconds_total{M}[15m])) / "
         f"clamp_min(sum(increase(raypaged:autoscaler_drains_total{M}[15m])), 1)",
         "mean drain (s, 15m)")]),
    ("timeseries", "Errors and retries", "short", [
        (f"sum by (status) (rate(raypaged:request_errors_total{M}[1m]))", "HTTP {{status}}"),
        (f"sum(rate(raypaged:request_retries_total{M}[1m]))", "retries"),
        (f"sum(increase(raypaged:worker_restarts_total{M}[5m]))", "worker restarts (5m)")]),
]


def queries() -> list[str]:
    """Every PromQL expression on the dashboard, in panel order."""
    return [expr for _, _, _, targets in PANELS for expr, _ in targets]


def _grid(index: int, kind: str) -> dict:
    stats = sum(p[0] == "stat" for p in PANELS)  # the stats come first, four to a row
    if kind == "stat":
        return {"x": 6 * (index % 4), "y": 6 * (index // 4), "w": 6, "h": 6}
    top = 6 * -(-stats // 4)
    i = index - stats
    return {"x": 12 * (i % 2), "y": top + 8 * (i // 2), "w": 12, "h": 8}


def _panel(index: int, kind: str, title: str, unit: str, targets) -> dict:
    options = ({"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
               if kind == "stat" else
               {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "none"}})
    return {
        "id": index + 1, "type": kind, "title": title, "datasource": DATASOURCE,
        "gridPos": _grid(index, kind),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options,
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + j)} for j, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {
        "title": "raypaged", "uid": "raypaged", "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "tags": ["raypaged", "llm", "ray"],
        "timezone": "browser", "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "refresh": 1, "hide": 0,
             "current": {"text": "default", "value": "default"}},
            {"name": "model_name", "label": "model", "type": "query", "datasource": DATASOURCE,
             "query": "label_values(raypaged:worker_up, model_name)", "refresh": 2,
             "includeAll": True, "multi": True, "allValue": ".*",
             "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": [_panel(i, *p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    text = render()
    for out in OUTPUTS:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)}")
