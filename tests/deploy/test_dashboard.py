"""The Grafana dashboard: the committed JSON files are what deploy/grafana/dashboard.py defines,
and that JSON type-checks against Grafana's own dashboard schema (@grafana/schema, with the
TypeScript compiler: unknown fields and wrong enum values are errors)."""
from __future__ import annotations

import json
import subprocess

from deploy_tools import ROOT, TOOLS, load_definition


def typecheck(dashboard: dict) -> subprocess.CompletedProcess:
    """tsc on `const d: Dashboard = <the JSON>`: an object literal, so excess properties count."""
    check = TOOLS / "npm" / "dashboard_check.ts"  # beside node_modules, so imports resolve
    check.write_text("import type { Dashboard } from '@grafana/schema';\n"
                     f"export const dashboard: Dashboard = {json.dumps(dashboard, indent=1)};\n")
    return subprocess.run(
        [str(TOOLS / "npm/node_modules/.bin/tsc"), "--noEmit", "--strict", "--module", "esnext",
         "--moduleResolution", "bundler", "--target", "es2022", "--skipLibCheck", str(check)],
        capture_output=True, text=True, timeout=300)


def test_committed_dashboards_match_their_definition():
    definition = load_definition()
    for out in definition.OUTPUTS:
        assert out.read_text() == definition.render(), (
            f"{out.relative_to(ROOT)} is stale: run python deploy/grafana/dashboard.py")


def test_the_datasource_is_a_variable_so_the_dashboard_provisions_as_is():
    dashboard = load_definition().dashboard()
    assert "__inputs" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    refs = [p["datasource"] for p in dashboard["panels"]]
    refs += [t["datasource"] for p in dashboard["panels"] for t in p["targets"]]
    assert {json.dumps(r) for r in refs} == {'{"type": "prometheus", "uid": "${datasource}"}'}


def test_the_dashboard_type_checks_against_grafanas_schema():
    done = typecheck(load_definition().dashboard())
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_catches_unknown_fields_and_wrong_values():
    unknown = load_definition().dashboard()
    unknown["refreshh"] = "10s"
    done = typecheck(unknown)
    assert done.returncode != 0
    assert "'\"refreshh\"' does not exist in type 'Dashboard'" in done.stdout
    wrong = load_definition().dashboard()
    wrong["templating"]["list"][0]["type"] = "datasourcez"
    done = typecheck(wrong)
    assert done.returncode != 0
    assert "not assignable to type 'VariableType'" in done.stdout
