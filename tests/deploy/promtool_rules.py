"""A `promtool test rules` file that runs every dashboard query over a real /metrics exposition.

The scraped samples become input series over ten 15 s steps: gauges hold their value, counters
(and histogram buckets, counts and sums) climb linearly from 0 to the scraped value, so rate()
and histogram_quantile() have something to work on. Each query becomes an alert on
`absent(query)`, expected never to fire: every query returns data.
"""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

STEPS, INTERVAL_S = 10, 15
EVAL_TIME = f"{STEPS * INTERVAL_S}s"


def input_series(exposition: str) -> list[dict]:
    series = []
    for family in text_string_to_metric_families(exposition):
        climbs = family.type in ("counter", "histogram")
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values = (f"0+{s.value / STEPS!r}x{STEPS}" if climbs and s.value
                      else f"{s.value!r}x{STEPS}")
            series.append({"series": f"{s.name}{{{labels}}}", "values": values})
    return series


def rules_and_tests(queries: list[str], exposition: str,
                    exact: dict[str, float]) -> tuple[dict, dict]:
    """(rule file, test file) as YAML-ready dicts; `exact` maps queries to the single value
    they must return."""
    rules = {"groups": [{"name": "dashboard-queries-return-data", "rules": [
        {"alert": f"DashboardQuery{i}HasNoData", "expr": f"absent({q})"}
        for i, q in enumerate(queries)]}]}
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": f"{INTERVAL_S}s",
        "tests": [{
            "interval": f"{INTERVAL_S}s",
            "input_series": input_series(exposition),
            "alert_rule_test": [{"eval_time": EVAL_TIME, "alertname": f"DashboardQuery{i}HasNoData",
                                 "exp_alerts": []} for i in range(len(queries))],
            "promql_expr_test": [{"expr": q, "eval_time": EVAL_TIME,
                                  "exp_samples": [{"labels": "{}", "value": v}]}
                                 for q, v in exact.items()],
        }],
    }
    return rules, tests
