"""The Grafana dashboards and Prometheus rules in dashboards/: the committed JSON is what dashboards/build.py makes,
the dashboards pass the rules of Grafana's dashboard linter (grafana/dashboard-linter, mirrored here: datasource
variable, multi-select job and instance with "All" = .+, job and instance matchers, $__rate_interval, units,
descriptions, not editable), "All" stays within tensorlane's scrape jobs, the fleet links to the host, every
query (and each variable's) parses and names only metrics the agent exports, labels they have and values they
take, and the rules pass `promtool check rules` and `promtool test rules` (a test case per rule; their windows hold
several scrapes at the default interval), each alert with a runbook section. Evaluating the panels against a live
Prometheus is in test_metrics_prometheus.py."""
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
RUNBOOK = DASHBOARDS.parent / "docs" / "runbook.md"
# Grafana units the panels may use (a subset of Grafana's unit ids; the linter's panel-units-rule checks ids)
UNITS = {"percentunit", "bytes", "s", "short", "pps", "Bps", "reqps", "ops", "bool"}
SELECTOR = re.compile(r"\b((?:tensorlane|process)_[a-z0-9_]+|up)\b(\{[^}]*\})?")


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


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_dashboard_follows_the_linter_rules(name):
    """template-datasource/job/instance, on-time-change-reload, uneditable, panel title/description/units,
    target job/instance matchers and rate interval (grafana/dashboard-linter)."""
    dash = load(name)
    assert dash["editable"] is False, "provisioned dashboards are not editable"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for var in ("job", "instance"):
        v = variables[var]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", var
        assert v["label"] == var.title() and v["multi"] and v["includeAll"] and v["allValue"] == ".+", var
        assert v["refresh"] == 2, var  # reload on time range change
        assert "tensorlane_build_info" in v["query"]["query"], var  # values: tensorlane agents only
    for p in build.panels(dash):
        assert p["title"] and p["description"], p["title"]
        assert p["fieldConfig"]["defaults"]["unit"] in UNITS, p["title"]
        for t in p["targets"]:
            for window in re.findall(r"\[([^\]]+)\]", t["expr"]):
                assert window == "$__rate_interval", f"{p['title']}: [{window}]"
            for metric, matchers in SELECTOR.findall(t["expr"]):
                assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, f"{p['title']}: {metric}"
                if not metric.startswith("tensorlane_"):  # every exporter has it: tensorlane's jobs only
                    assert 'job=~"tensorlane.*"' in matchers, f"{p['title']}: {metric}"


def test_fleet_links_to_the_host_dashboard():
    fleet, host = load("tensorlane-fleet.json"), load("tensorlane-host.json")
    url = f"/d/{host['uid']}/"
    assert any(link["url"].startswith(url) and link["includeVars"] and link["keepTime"] for link in fleet["links"])
    per_host = [p for p in build.panels(fleet) if any("{{instance}}" in t["legendFormat"] for t in p["targets"])]
    assert len(per_host) >= 6
    for p in per_host:
        links = p["fieldConfig"]["defaults"]["links"]
        assert any(link["url"].startswith(url) and "var-instance=${__field.labels.instance}" in link["url"]
                   for link in links), p["title"]
    assert any(link["url"].startswith(f"/d/{fleet['uid']}/") for link in host["links"])


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_borrowing_and_process_panels(name):
    """Each level borrowing while the default class waits; the agent's own process_* metrics."""
    by_title = {p["title"]: p for p in build.panels(load(name))}
    exprs = " ".join(t["expr"] for t in by_title["HTB borrowing by level, default class waiting"]["targets"])
    assert "tensorlane_class_borrowed_packets_total" in exprs and 'level="default"' in exprs
    assert "process_cpu_seconds_total" in by_title["Agent CPU"]["targets"][0]["expr"]
    assert "process_resident_memory_bytes" in by_title["Agent memory"]["targets"][0]["expr"]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_joins_keep_the_scrape_job_and_shares_of_several_links_are_not_stacked(name):
    """Two scrape jobs of ``tensorlane*`` may scrape one instance (a canary beside production): a join ``on``
    (or a ``group by``/``sum by`` feeding one) without ``job`` then finds two series a side and the query fails, the
    panel blank; a share of a link stacked over a host's devices adds their links' shares past 100 %; a legend
    without ``{{device}}`` names a multi-NIC host's series alike."""
    for panel in build.panels(load(name)):
        for target in panel["targets"]:
            for by in re.findall(r"\b(?:on|group by|sum by) \(([^)]*)\)", target["expr"]):
                labels = {label.strip() for label in by.split(",")}
                if "instance" in labels:
                    assert "job" in labels, (panel["title"], target["expr"])
            # a series of a queue device (the class series read from tc, their info aside) that no outer
            # aggregation sums over the devices keeps ``device``: until 2026-11-29 the borrowing and token panels
            # had none in their legends (their joins on the class alone do not name it, which this check needed)
            outer = re.match(r"\s*(?:sum|max|min|avg) by \(([^)]*)\)", target["expr"])
            per_device = (re.search(r"\btensorlane_class_(?!info\b)\w+", target["expr"])
                          and (outer is None or "device" in outer.group(1)))
            if per_device or ("level" in target["legendFormat"] and "device" in target["expr"]):
                assert "{{device}}" in target["legendFormat"], (panel["title"], target["legendFormat"])
        if panel.get("fieldConfig", {}).get("defaults", {}).get("unit") == "percentunit":
            stacking = panel["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {})
            assert stacking.get("mode", "none") == "none", panel["title"]


def test_the_host_dashboard_shows_the_dscp_resets_that_kernel_tcp_dscp_is_tuned_by():
    """docs/metrics.md and docs/agent.md tell the operator to watch tensorlane_unregistered_dscp_reset_packets_total
    (a steady rise: a kernel TCP client root gave a DSCP, to list in kernel_tcp_dscp); until 2026-11-29 no panel
    showed it."""
    exprs = [t["expr"] for p in build.panels(load("tensorlane-host.json")) for t in p["targets"]]
    assert any("rate(tensorlane_unregistered_dscp_reset_packets_total" in e for e in exprs)


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


def _agent():
    """A fake agent that exports every source's series: a job policy's ("auto"'s too) and a flow table file's (a
    journal that writes nothing here: the daemon always keeps one)."""
    from tensorlane.agent.handover import FlowJournal

    api = fake_api(job_policy="shortest", job_share="auto")
    api.journal = FlowJournal(api.cfg, api.table)
    return api


def _exported_samples() -> set[str]:
    """The name of every sample an agent exports (with the ``kernel`` fixture's classes), job policy ones included."""
    from tensorlane.agent.metrics import make_registry

    class Server:  # what the connections source reads from the socket server at a scrape
        def connection_counts(self):
            return {"privileged": 1, "user": 0, "users_at_limit": 0, "max_connections": 1024,
                    "reserved_connections": 32, "max_connections_per_user": 64}

    api = _agent()
    api.server = Server()
    registry, _ = make_registry(api)  # subscribes to the api's requests from now on
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    request(api, op="register", job="b", level=0, flows=[flow(2)])
    api.jobs.observe({0}, 1.0)  # one sample: the link's busy share
    request(api, op="report", job="a", session="s", levels=[{"level": 0, "allreduces": 1, "bytes": 1,
                                                                 "comm_s": 0.1}], step_bytes=4096,
            compute_s=0.5)
    text = generate_latest(registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_queries_and_rules_name_only_metrics_the_agent_exports(kernel):  # noqa: F811
    exported = _exported_samples()
    used = set()
    for name in DASHBOARD_NAMES:
        dash = load(name)
        variables = [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
        for expr in [e for _, _, e in build.queries(dash)] + variables:  # a variable of no series lists nothing
            used |= set(re.findall(r"\b((?:tensorlane|process)_[a-z0-9_]+)", expr))
    rules = (DASHBOARDS / "rules.yml").read_text()
    used |= set(re.findall(r"\b(tensorlane_[a-z0-9_]+)", rules))
    assert used and not used - exported, f"not exported by the agent: {sorted(used - exported)}"


# Names the docs give as what a metric or rule was called before a rename (each page says until when).
FORMER_NAMES = {"tensorlane_class_lends_total", "tensorlane_class_borrows_total",
                "tensorlane:class_link_share:ratio_rate1m"}


def test_the_docs_name_only_metrics_the_agent_exports(kernel):  # noqa: F811
    """Every ``tensorlane_*`` metric and ``tensorlane:*`` recording rule that README.md and docs/ name (what an operator
    copies into a query, or looks for on a dashboard: the runbook's checks, docs/metrics.md's table) is a series the
    agent exports or a rule of rules.yml; the Ansible role's variables and tags (``tensorlane_levels``), a family
    (``tensorlane_class_*``) and the former names of renamed metrics are not metrics. The test above checks the
    dashboards and rules."""
    import yaml

    exported = _exported_samples()
    exported |= {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}  # a histogram by its name
    rules = [r for g in yaml.safe_load((DASHBOARDS / "rules.yml").read_text())["groups"] for r in g["rules"]]
    records = {r["record"] for r in rules if "record" in r}
    role = DASHBOARDS.parent / "ansible" / "roles" / "tensorlane"
    not_metrics = set(yaml.safe_load((role / "defaults" / "main.yml").read_text())) | {"tensorlane_interface"}
    not_metrics |= set(re.findall(r"\b(tensorlane_\w+)", (role / "tasks" / "main.yml").read_text()))  # tags
    pages = [DASHBOARDS.parent / "README.md", *sorted((DASHBOARDS.parent / "docs").glob("*.md"))]
    unknown = []
    for page in pages:
        text = page.read_text()
        for m in re.finditer(r"(?<![\w./-])(tensorlane:[a-z0-9_:]*[a-z0-9]|tensorlane_[a-z0-9_]*[a-z0-9])(?![\w*])",
                             text):
            name = m.group(1)
            if name not in exported | records | not_metrics | FORMER_NAMES:
                unknown.append(f"{page.name}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not unknown, f"not exported by the agent, nor a rule or a role variable: {unknown}"


def test_the_refusals_the_alert_counts_start_at_zero():
    """TensorlaneRegistrationsRefused takes ``increase()`` of each refusal's series, which misses a series' first
    count: every outcome its matcher names is a series from the agent's start, at zero (until 2026-11-27 only
    ``ok`` was, so the first refusals of each kind after a start were not counted)."""
    from tensorlane.agent.metrics import make_registry
    from tensorlane.agent.metrics.api import REGISTER_REFUSALS

    rules = (DASHBOARDS / "rules.yml").read_text()
    matcher = re.search(r'op="register",\s*outcome=~"([^"]+)"', rules)
    assert matcher and set(matcher.group(1).split("|")) == set(REGISTER_REFUSALS), matcher
    registry, _ = make_registry(fake_api())
    text = generate_latest(registry).decode()
    for outcome in REGISTER_REFUSALS:
        assert f'tensorlane_api_requests_total{{op="register",outcome="{outcome}"}} 0.0' in text, outcome


def test_queries_and_rules_use_only_labels_their_metrics_have(kernel):  # noqa: F811
    """A label matcher of a selector names a label of that metric, and a ``by``/``on``/``group_left`` list names a
    label of the metrics the expression reads (a recording rule's through its own expression), or ``job`` and
    ``instance``: a wrong label name selects nothing, silently (an alert that never fires, a panel that is empty).
    The test above checks the metric names only."""
    import yaml

    from tensorlane.agent.metrics import make_registry

    api = _agent()
    registry, _ = make_registry(api)
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    request(api, op="register", job="b", level=0, flows=[flow(2)])
    api.jobs.observe({0}, 1.0)  # one sample: the link's busy share
    request(api, op="report", job="a", session="s", levels=[{"level": 0, "allreduces": 1, "bytes": 1,
                                                                 "comm_s": 0.1}], step_bytes=4096, compute_s=0.5)
    labels: dict[str, set] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in fam.samples:
            labels.setdefault(sample.name, set()).update(sample.labels, {"job", "instance"})
    rules = [r for g in yaml.safe_load((DASHBOARDS / "rules.yml").read_text())["groups"] for r in g["rules"]]
    exprs = [(f"rule {r.get('alert') or r['record']}", r["expr"]) for r in rules]
    exprs += [(f"{name}: {title}", build.expand(e)) for name in DASHBOARD_NAMES
              for title, _, e in build.queries(load(name))]
    names = re.compile(r"\b(tensorlane:[a-z0-9_:]+|(?:tensorlane|process)_[a-z0-9_]+)(\{[^}]*\})?")
    for r in rules:  # a recording rule's series have the labels of what it reads
        if "record" in r:
            labels[r["record"]] = set().union(*(labels[m] for m, _ in names.findall(r["expr"])))
    for where, expr in exprs:
        used = names.findall(expr)
        for metric, matchers in used:
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in labels[metric], f"{where}: {metric} has no label {label!r}"
        read = set().union(*(labels[m] for m, _ in used))
        for clause in re.findall(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
            for label in filter(None, (x.strip() for x in clause.split(","))):
                assert label in read, f"{where}: no metric it reads has the label {label!r}"


def test_rules_pass_promtool_check_and_unit_tests():
    check = subprocess.run([promtool(), "check", "rules", "rules.yml"], cwd=DASHBOARDS, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    for tests in ("rules_test.yml", "rules_test_scrape_1m.yml"):  # the second: scrapes every 1m, off the evaluations
        test = subprocess.run([promtool(), "test", "rules", tests], cwd=DASHBOARDS, capture_output=True, text=True,
                              timeout=120)
        assert test.returncode == 0 and "SUCCESS" in test.stdout, tests + ": " + test.stdout + test.stderr


def test_every_rules_window_holds_several_scrapes_at_the_default_interval():
    """Every range of rules.yml (``rate(x[5m])``, ``avg_over_time``, ``increase``) spans at least 4 scrapes at
    Prometheus' default scrape interval, 1m (docs/deploy.md's scrape config sets none), as Prometheus advises: a
    window of one interval holds one sample off the scrape times, and its rate() is nothing. Until 2026-11-28
    ``tensorlane:class_link_share:ratio_rate1m`` took ``rate(...[1m])``: empty at every evaluation
    (rules_test_scrape_1m.yml shows it with promtool)."""
    import yaml

    seconds = {"s": 1, "m": 60, "h": 3600}
    for group in yaml.safe_load((DASHBOARDS / "rules.yml").read_text())["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            for number, unit in re.findall(r"\[(\d+)([smh])(?::[^\]]*)?\]", rule["expr"]):
                assert int(number) * seconds[unit] >= 4 * 60, f"{name}: [{number}{unit}] is under 4 scrapes of 1m"
            window = re.search(r"_rate(\d+[smh])$", name)  # a recorded rate's name says its window
            if window:
                assert f"[{window.group(1)}]" in rule["expr"], f"{name}: its name and its window differ"


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


def test_every_alert_has_a_runbook_section():
    import yaml

    rules = yaml.safe_load((DASHBOARDS / "rules.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    sections = {h.strip().lower() for h in re.findall(r"^## (.+)$", RUNBOOK.read_text(), re.M)}
    for a in alerts:
        url = a["annotations"].get("runbook_url", "")
        assert url == f"docs/runbook.md#{a['alert'].lower()}", a["alert"]
        assert a["alert"].lower() in sections, f"docs/runbook.md has no section {a['alert']}"


def test_the_alert_table_of_docs_metrics_is_rules_yml():
    """docs/metrics.md's alert table names every alert of rules.yml with its `for` and its threshold (``> N %`` or
    ``> N ms`` in the table is the number the rule compares with)."""
    import yaml

    rules = yaml.safe_load((DASHBOARDS / "rules.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    doc = (DASHBOARDS.parent / "docs" / "metrics.md").read_text()
    rows = {m[0]: (m[1], m[2]) for m in re.findall(r"^\| `(Tensorlane\w+)` \| (.*) \| (\w+) \|$", doc, re.M)}
    assert set(rows) == set(alerts), sorted(set(rows) ^ set(alerts))
    for name, (when, duration) in rows.items():
        assert alerts[name]["for"] == duration, f"{name}: docs say for {duration}, rules.yml {alerts[name]['for']}"
        numbers = {float(x) for x in re.findall(r"\b\d+(?:\.\d+)?\b", alerts[name]["expr"])}
        for value, unit in re.findall(r"> (\d+(?:\.\d+)?) (%|ms)(?!\w)", when):
            assert float(value) / {"%": 100, "ms": 1000}[unit] in numbers, f"{name}: docs say > {value} {unit}"


def test_queries_and_rules_match_only_label_values_the_agent_exports(kernel):  # noqa: F811
    """Each ``label="value"`` matcher of a selector (and each alternative of a ``label=~"a|b"`` one) of the rules and
    panels matches a value the agent exports for that metric's label (``job`` and ``instance`` aside: Prometheus'
    own): ``level="0"``, ``level="default"``, ``op="register"``, the refusal reasons the alerts count. A value the
    agent never exports selects nothing, silently, as a wrong label name does (the test above)."""
    import yaml

    from tensorlane.agent.metrics import make_registry

    api = _agent()
    registry, _ = make_registry(api)
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    values: dict[tuple[str, str], set] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in fam.samples:
            for label, value in sample.labels.items():
                values.setdefault((sample.name, label), set()).add(value)
    rules = [r for g in yaml.safe_load((DASHBOARDS / "rules.yml").read_text())["groups"] for r in g["rules"]]
    exprs = [(f"rule {r.get('alert') or r['record']}", r["expr"]) for r in rules]
    exprs += [(f"{name}: {title}", e) for name in DASHBOARD_NAMES for title, _, e in build.queries(load(name))]
    checked = 0
    for where, expr in exprs:
        for metric, matchers in SELECTOR.findall(expr):
            for label, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', matchers):
                if label in ("job", "instance") or "$" in value:
                    continue
                seen = values.get((metric, label), set())
                for want in value.split("|") if op == "=~" else [value]:
                    assert any(re.fullmatch(want, v) for v in seen), \
                        f"{where}: {metric} has no {label} matching {want!r} (it exports {sorted(seen)})"
                    checked += 1
    assert checked >= 10


def test_the_documented_scrape_config_fits_grafanas_rate_interval():
    """The dashboards' ``rate(x[$__rate_interval])``: Grafana makes ``$__rate_interval`` 4 x the data source's
    "Scrape interval" (15s unless set) at short time ranges, 60s: scraped at Prometheus' default of 1m, such a window
    holds one sample off the scrape times and every rate panel is empty (Grafana's dashboards of the last hours). So
    each scrape config of tensorlane in the docs scrapes every 15s or less; until 2026-11-28 docs/deploy.md's set no
    interval (Prometheus' 1m)."""
    import yaml

    seconds = {"s": 1, "m": 60}
    found = 0
    for page in sorted((DASHBOARDS.parent / "docs").glob("*.md")):
        for block in re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S):
            if "scrape_configs:" not in block:
                continue
            config = yaml.safe_load(block)
            default = config.get("global", {}).get("scrape_interval", "1m")
            for job in config["scrape_configs"]:
                if job["job_name"].startswith("tensorlane"):
                    value = re.fullmatch(r"(\d+)([sm])", str(job.get("scrape_interval", default)))
                    assert value and int(value.group(1)) * seconds[value.group(2)] <= 15, (page.name, job)
                    found += 1
    assert found, "no scrape config of tensorlane in docs/"


def test_the_docs_promql_examples_parse_and_keep_the_scrape_job_in_their_joins(tmp_path):
    """The ```promql examples of docs/ parse (promtool) and, like the panels, join ``on`` (or group ``by``) ``job``
    wherever they name ``instance``: a reader who copies one to a Prometheus with two tensorlane scrape jobs of one
    instance (a canary) gets a many-to-many error otherwise (until 2026-11-28 docs/metrics.md's joined on
    ``instance`` alone)."""
    blocks = [b for page in sorted((DASHBOARDS.parent / "docs").glob("*.md"))
              for b in re.findall(r"```promql\n(.*?)```", page.read_text(), re.S)]
    # one expression per line, a line indented by two spaces continues the one above it
    exprs = []
    for line in "\n".join(blocks).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith("  ") and exprs:
            exprs[-1] += " " + line.strip()
        else:
            exprs.append(line.strip())
    assert exprs
    lines = ["groups:", "  - name: docs", "    rules:"]
    for i, expr in enumerate(exprs):
        for by in re.findall(r"\b(?:on|by)\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in by.split(",")}
            assert "instance" not in labels or "job" in labels, expr
        lines += [f"      - record: docs:example:{i}", f"        expr: '{expr}'"]
    path = tmp_path / "docs.yml"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
