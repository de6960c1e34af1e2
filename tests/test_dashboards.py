"""The Grafana dashboards and Prometheus rules in dashboards/: the committed JSON is what dashboards/build.py makes,
every panel has a unit and the ${datasource} variable, every query parses and names only metrics the agent
exports, and the rules pass `promtool check rules` and `promtool test rules` (a test case per rule). Evaluating
the panels against a live Prometheus is in test_metrics_prometheus.py."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import fake_api, flow, kernel, request  # noqa: F401 (kernel is a fixture)

from dashboards import build

DASHBOARDS = Path(build.__file__).resolve().parent
DASHBOARD_NAMES = sorted(build.DASHBOARDS)


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: apt-get install prometheus (scripts/bootstrap)"
    return path


def load(name: str) -> dict:
    import json

    return json.loads((DASHBOARDS / name).read_text())


def test_committed_json_is_what_build_makes():
    assert build.main(["--check"]) == 0, "run: python -m dashboards.build"
    assert DASHBOARD_NAMES == ["tensorlane-fleet.json", "tensorlane-host.json"]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_every_panel_has_a_unit_and_uses_the_datasource_variable(name):
    dash = load(name)
    ds_vars = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert ds_vars and ds_vars[0]["type"] == "datasource" and ds_vars[0]["query"] == "prometheus"
    panels = build.panels(dash)
    assert len(panels) >= 10
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} has no unit"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["expr"].strip() and t["legendFormat"], p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}", v["name"]


def test_fleet_dashboard_shows_what_the_issue_asks_for():
    titles = " | ".join(p["title"] for p in build.panels(load("tensorlane-fleet.json"))).lower()
    for want in ("link share", "backlog", "inversion", "all-reduce time by job and level", "queueing delay"):
        assert want in titles, want


def test_every_query_parses_as_promql(tmp_path):
    """promtool parses each (variables substituted) expression as the expression of a recording rule."""
    lines = ["groups:", "  - name: panels", "    rules:"]
    for name in DASHBOARD_NAMES:
        for i, (_title, _ref, expr) in enumerate(build.queries(load(name))):
            lines.append(f"      - record: panel:{Path(name).stem.replace('-', '_')}:{i}")
            lines.append("        expr: |")
            lines += [f"          {line}" for line in build.expand(expr).splitlines()]
    path = tmp_path / "panels.yml"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_expand_leaves_no_variable_and_refuses_unknown_ones():
    for name in DASHBOARD_NAMES:
        for _, _, expr in build.queries(load(name)):
            assert "$" not in build.expand(expr)
    with pytest.raises(KeyError):
        build.expand("rate(x[$nope])")


def test_queries_and_rules_name_only_metrics_the_agent_exports(kernel):  # noqa: F811
    from tensorlane.agent.metrics import make_registry

    api = fake_api()
    registry, _ = make_registry(api)  # subscribes to the api's requests from now on
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    request(api, op="report", job="a", session="s", levels=[{"level": 0, "allreduces": 1, "bytes": 1,
                                                                 "comm_s": 0.1}])
    text = generate_latest(registry).decode()
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    used = set()
    for name in DASHBOARD_NAMES:
        for _, _, expr in build.queries(load(name)):
            used |= set(re.findall(r"\b(tensorlane_[a-z0-9_]+)", expr))
    rules = (DASHBOARDS / "rules.yml").read_text()
    used |= set(re.findall(r"\b(tensorlane_[a-z0-9_]+)", rules))
    assert used and not used - exported, f"not exported by the agent: {sorted(used - exported)}"


def test_rules_pass_promtool_check_and_unit_tests():
    check = subprocess.run([promtool(), "check", "rules", "rules.yml"], cwd=DASHBOARDS, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool(), "test", "rules", "rules_test.yml"], cwd=DASHBOARDS, capture_output=True,
                          text=True, timeout=120)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_rule_has_a_test_case():
    rules = (DASHBOARDS / "rules.yml").read_text()
    tests = (DASHBOARDS / "rules_test.yml").read_text()
    alerts = re.findall(r"^\s*- alert:\s*(\S+)", rules, re.M)
    records = re.findall(r"^\s*- record:\s*(\S+)", rules, re.M)
    assert len(alerts) >= 4 and len(records) >= 3
    tested_alerts = set(re.findall(r"^\s*alertname:\s*(\S+)", tests, re.M))
    tested_exprs = set(re.findall(r"^\s*- expr:\s*(\S+)", tests, re.M))
    assert set(alerts) <= tested_alerts, f"alerts without a test: {sorted(set(alerts) - tested_alerts)}"
    assert set(records) <= tested_exprs, f"recording rules without a test: {sorted(set(records) - tested_exprs)}"
    for wanted in ("TensorlanePriorityInversion", "TensorlaneAgentDown", "TensorlaneReconcileFailing",
                   "TensorlaneTopClassQueueDelayHigh"):
        assert wanted in alerts
