"""bench.report: the results page and the README's headline block from small synthetic JSON files (missing files
and keys included), marker replacement (idempotent, nothing outside the markers touched), ``--check`` and the PNG
plots; docs/jobs-measured.md's per-policy table (its jobs-figures block) and the repository's files up to date."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import report
from bench.report import (
    BEGIN,
    END,
    ReportError,
    main,
    render,
    replace_section,
    split_readme,
    verdict,
)

MACHINE = {"cores": 2, "memory_bytes": 24 * 2**30, "kernel": "6.18.0", "python": "3.11.7", "torch": "2.13.0+cpu",
           "date": "2026-11-22T05:00:00Z"}

SAMPLES = {
    "contention": {"hosts": 3, "rate": "200mbit", "link_bps": 200_000_000, "iters": 10, "workload": "allreduce",
                   "uncontended_s": 0.446, "fifo_s": 1.794, "agent_s": 0.446, "agent_ratio": 1.0,
                   "fifo_ratio": 4.02, "bulk_after_ratio": 0.93,
                   "bulk_after_bps": {"h1->h2": 187e6, "h2->h1": 190e6}, "elapsed_s": 75.2, "machine": MACHINE,
                   "targets": {"agent_ratio_max": 1.1, "fifo_ratio_min": 2.0, "bulk_after_ratio_min": 0.8}},
    "priority": {"rate": "200mbit", "hosts": 2, "iters": 8, "rounds": 3, "elapsed_s": 476,
                 "profiles": {"resnet50": {"ddp_s": 1.216, "app_order_s": 1.195, "shim_s": 0.988,
                                           "lower_bound_s": 0.818},
                              "bert_base": {"ddp_s": 1.124, "app_order_s": 1.104, "shim_s": 1.073}}},  # no LB
    "jobs": {"rate": "200mbit", "hosts": 2, "elapsed_s": 300, "quick": True, "iters": 4, "reps": 1,
             "machine": {"cpus": 2, "kernel": "6.18.0", "python": "3.11.7", "mem_gib": 23.5},
             "runs": {"2": {"fifo_avg_s": 10.0, "static_avg_s": 8.0, "rotate_avg_s": 7.0, "fifo_worst_s": 12.0,
                            "static_worst_s": 14.0, "rotate_worst_s": 11.0, "fifo_jct_s": [8.0, 12.0],
                            "rotate_jct_s": [3.0, 11.0], "rotate_vs_fifo_avg": 0.7,
                            "rotate_worst_vs_fifo_worst": 0.9167, "pass": True},
                      "4": {"fifo_avg_s": 20.0, "rotate_avg_s": 18.0, "fifo_worst_s": 25.0, "rotate_worst_s": 26.0}}},
    "control-plane": {"rate": "1gbit", "machine": "2 cores (this project's CI machine kind)",
                      "sizes": {"0": {"register_p50_ms": 0.7, "register_p99_ms": 1.1, "throughput_bps": 9e8,
                                      "throughput_ratio": 1.0},
                                "1000": {"register_p50_ms": 0.8, "register_p99_ms": 1.3, "throughput_bps": 8.6e8,
                                         "throughput_ratio": 0.96},
                                "10000": {"register_p50_ms": 1.7, "register_p99_ms": 12.5, "throughput_bps": 8.3e8,
                                          "throughput_ratio": 0.92}},
                      "soak": {"clients": 200, "seconds": 60}},
    # shim-overhead: missing on purpose; classifier: optional, missing
}


def write_results(d, samples=SAMPLES):
    d.mkdir(parents=True, exist_ok=True)
    for name, obj in samples.items():
        (d / f"{name}.json").write_text(json.dumps(obj))
    return d


def readme(tmp_path, body="(not generated yet)"):
    path = tmp_path / "README.md"
    path.write_text(f"# project\n\nintro\n\n{BEGIN}\n{body}\n{END}\n\n## after\n\ntail text\n")
    return path


def table_rows(section: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| benchmark")]


def test_verdict_and_margins():
    assert verdict(0.83, "<=", 0.80) == ("**missed** by 0.03", "0.03")
    assert verdict(0.80, "<=", 0.80) == ("met", None)
    assert verdict(1.054, "<=", 1.05) == ("**missed** by 0.004", "0.004")
    assert verdict(0.97, "<", 1.0) == ("met", None)
    assert verdict(1.0, "<", 1.0)[0].startswith("**missed**")
    assert verdict(1.5, ">=", 2.0) == ("**missed** by 0.50", "0.50")
    assert verdict(12.5, "<=", 10, " ms") == ("**missed** by 2.50 ms", "2.50 ms")
    assert verdict(None, "<=", 1.0) == ("-", None)
    assert verdict("x", "<=", 1.0) == ("-", None)
    assert report.fmt_s(0.446) == "446 ms" and report.fmt_s(0.0084) == "8.4 ms" and report.fmt_s(12.34) == "12.34 s"
    assert report.fmt_s(0.5, "s") == "0.50 s" and report.time_unit(0.4, 12.0) == "s" and report.time_unit(9.9) == "ms"
    assert report.fmt_rate("200mbit") == "200 Mbit/s" and report.fmt_rate("10gbit") == "10 Gbit/s"


def test_render_rows_missing_files_and_keys(tmp_path):
    results = report.load(str(write_results(tmp_path / "results")))
    section = render(results)
    rows = table_rows(section)
    by_figure = {(r[0], r[1]): r for r in rows}
    print(section)

    # contention: ours, the alternatives, ratio, target, verdict
    r = by_figure[("contention", "all-reduce under bulk with agents, vs alone")]
    assert r[2:] == ["446 ms", "alone 446 ms; FIFO under bulk 1794 ms", "1.00", "<= 1.10", "met"]
    assert by_figure[("contention", "all-reduce under bulk with FIFO NICs, vs alone (contention is real)")][4] == "4.02"
    # priority: ResNet-50 misses the DDP target by 0.01; BERT-base has no lower bound: "-", not a crash
    r = by_figure[("priority", "ResNet-50: shim vs plain DDP")]
    assert r[4:] == ["0.81", "<= 0.80", "**missed** by 0.01"]
    assert by_figure[("priority", "ResNet-50: shim vs application order only")][6] == "met"
    r = by_figure[("priority", "BERT-base: shim vs lower bound")]
    assert r[3] == "lower bound -" and r[4] == "-" and r[6] == "-"
    # the dependency-aware bound: no scales in these figures, so it cannot be derived: "-", informational
    r = by_figure[("priority", "ResNet-50: shim vs dependency-aware lower bound")]
    assert r[3:] == ["dependency-aware lower bound -", "-", "none (informational)", "-"]
    # jobs: 2 jobs meet both; 4 jobs: static missing ("-"), average missed by 0.15, worst missed
    r = by_figure[("jobs", "2 jobs: average JCT, rotation vs FIFO")]
    assert r[2:] == ["7.00 s", "FIFO 10.00 s; static priority 8.00 s", "0.70", "<= 0.75", "met"]
    r = by_figure[("jobs", "4 jobs: average JCT, rotation vs FIFO")]
    assert "static priority -" in r[3] and r[4] == "0.90" and r[6] == "**missed** by 0.15"
    assert by_figure[("jobs", "4 jobs: worst JCT, rotation vs FIFO")][6] == "**missed** by 0.04"
    # "no job worse": per job from the lists (job 0 first); the 4-job run has no lists: no such row
    r = by_figure[("jobs", "2 jobs: no job worse than FIFO (largest per-job JCT ratio, job 1)")]
    assert r[2:] == ["11.00 s", "FIFO 12.00 s", "0.92", "<= 1.00", "met"]
    assert not any(k[1].startswith("4 jobs: no job worse") for k in by_figure)
    # control plane: the target applies at 10,000 flows; p99 12.5 ms misses it by 2.5 ms
    r = by_figure[("control-plane", "register p99, 10,000 flows registered")]
    assert r[2] == "12.50 ms" and r[5] == "<= 10 ms" and r[6] == "**missed** by 2.50 ms"
    assert by_figure[("control-plane", "register p99, 1,000 flows registered")][5] == "-"
    assert by_figure[("control-plane", "iperf3 through the host queue, 10,000 flows vs 0")][6] == "met"
    # shim-overhead is missing: a "not run" row; classifier (optional) missing: no row at all
    assert ("shim-overhead", "-") in by_figure and by_figure[("shim-overhead", "-")][6] == "not run"
    assert not any(r[0] == "classifier" for r in rows)
    # the summary says what was missed and by how much; the run lines say machine, link, repetitions
    assert "Targets missed (6 of 15 measured):" in section
    line = next(x for x in section.splitlines() if x.startswith("- **jobs**"))
    assert "(quick run): 2 hosts at 200 Mbit/s; 4 iterations per job; JCT per job from 1 run" in line
    assert "2 cores, 23.5 GiB, Linux 6.18.0" in line
    assert "- control-plane, register p99, 10,000 flows registered: 12.50 ms against <= 10 ms, missed by 2.50 ms" \
        in section.splitlines()
    assert "- priority, ResNet-50: shim vs plain DDP: 0.81 against <= 0.80, missed by 0.01" in section.splitlines()
    assert "Not measured: shim-overhead, realtrain." in section
    assert "**Quick runs**" in section and "jobs" in section.split("**Quick runs**")[1].splitlines()[0]
    line = next(x for x in section.splitlines() if x.startswith("- **contention**"))
    assert "3 hosts at 200 Mbit/s" in line and "median of 10 iterations per phase" in line
    assert "2 cores, 24.0 GiB, Linux 6.18.0" in line and "torch 2.13.0+cpu" in line and "2026-11-22" in line
    assert "[plot](docs/img/bench-contention.png)" in line
    line = next(x for x in section.splitlines() if x.startswith("- **priority**"))
    assert "48" not in line and "median of 24 iterations per mode" in line and "machine not recorded" in line
    line = next(x for x in section.splitlines() if x.startswith("- **control-plane**"))
    assert "machine: 2 cores (this project's CI machine kind)" in line and "soak 200 clients x 60 s" in line
    assert "- **shim-overhead**: not run" in section


def test_render_survives_garbage(tmp_path):
    d = tmp_path / "results"
    write_results(d, {"contention": {}, "priority": {"profiles": {"resnet50": None}}, "jobs": {"runs": {"2": "x"}},
                      "control-plane": {"sizes": {"0": {}}}, "shim-overhead": {"ratio": "fast"}})
    (d / "classifier.json").write_text("{not json")
    section = render(report.load(str(d)))
    rows = table_rows(section)
    assert any(r[0] == "classifier" and r[2].startswith("unreadable (JSONDecodeError") for r in rows)
    assert any(r[1] == "register p99 and throughput, 10,000 flows" and r[6] == "not run" for r in rows)
    assert all(len(r) == 7 for r in rows)
    empty = render(report.load(str(tmp_path / "nowhere")))
    assert sum(1 for r in table_rows(empty) if r[6] == "not run") == 6


def test_marker_replacement_is_idempotent_and_local():
    text = f"a\n{BEGIN}\nold\n{END}\nb | c\n"
    once = replace_section(text, "new table")
    assert once == f"a\n{BEGIN}\nnew table\n{END}\nb | c\n"
    assert replace_section(once, "new table") == once
    assert split_readme(once)[1] == "\nnew table\n"
    for bad in ("no markers", f"{END}\n{BEGIN}", f"{BEGIN}{BEGIN}{END}"):
        with pytest.raises(ReportError):
            replace_section(bad, "x")


def test_cli_writes_page_readme_block_plots_and_check(tmp_path, capsys):
    results = write_results(tmp_path / "results")
    path = readme(tmp_path)
    page = results / "README.md"                               # the default page: README.md in --results
    img = tmp_path / "docs" / "img"
    before = path.read_text()
    args = ["--results", str(results), "--readme", str(path), "--img-dir", str(img)]

    assert main(args + ["--check"]) == 1                       # "(not generated yet)", no page: stale
    assert path.read_text() == before and not page.exists()    # --check writes nothing
    assert main(args) == 0
    text = path.read_text()
    assert text.startswith("# project\n\nintro\n\n" + BEGIN) and text.endswith(END + "\n\n## after\n\ntail text\n")
    # the README's block: one headline figure per benchmark (priority: every profile vs DDP), a link to the page
    block = split_readme(text)[1]
    assert "[results/README.md](results/README.md)" in block and "9 of 15 measured targets met" in block
    heads = {(r[0], r[1]) for r in table_rows(block)}
    assert ("contention", "all-reduce under bulk with agents, vs alone") in heads
    assert {("priority", "ResNet-50: shim vs plain DDP"), ("priority", "BERT-base: shim vs plain DDP")} <= heads
    assert ("control-plane", "register p99, 10,000 flows registered") in heads
    assert ("shim-overhead", "-") in heads and len(block.splitlines()) < 20
    assert "Runs:" not in block and "bench-contention.png" not in block
    # the page: every figure, the run lines, the plots embedded, links relative to the page
    body = page.read_text()
    assert body.startswith("# Measured results\n") and "(../docs/benchmarks.md)" in body
    assert "| contention | all-reduce under bulk with agents, vs alone |" in body
    assert "| contention | bulk once training stops (agents on), share of the link |" in body
    assert "[plot](../docs/img/bench-contention.png)" in body and "![jobs](../docs/img/bench-jobs.png)" in body
    assert "[docs/priority.md](../docs/priority.md)" in body and "Predicted vs measured" not in body
    for name in ("contention", "priority", "jobs", "control-plane"):
        png = img / f"bench-{name}.png"
        assert png.exists() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (img / "bench-shim-overhead.png").exists()    # not run: no plot
    assert main(args + ["--check"]) == 0                       # up to date
    assert main(args) == 0 and path.read_text() == text and page.read_text() == body   # idempotent

    # a new figure makes the page and the README stale; a removed plot too; a hand edit of the page too
    obj = dict(SAMPLES["contention"], agent_s=0.52)
    (results / "contention.json").write_text(json.dumps(obj))
    capsys.readouterr()
    assert main(args + ["--check"]) == 1
    assert "differs" in capsys.readouterr().out
    assert main(args) == 0 and "| 520 ms |" in path.read_text() and "| 520 ms |" in page.read_text()
    assert main(args + ["--check"]) == 0
    os.unlink(img / "bench-priority.png")
    assert main(args + ["--check"]) == 1
    assert "bench-priority.png" in capsys.readouterr().out
    assert main(args) == 0
    page.write_text(page.read_text() + "edited by hand\n")
    assert main(args + ["--check"]) == 1 and str(page) in capsys.readouterr().out
    other = tmp_path / "elsewhere" / "page.md"                  # --page: links follow the page
    assert main(args + ["--page", str(other)]) == 0
    assert "[plot](../docs/img/bench-contention.png)" in other.read_text()
    assert "[elsewhere/page.md](elsewhere/page.md)" in path.read_text()


def test_validate_section(tmp_path):
    """``validate.json`` (optional): predictions vs measurements within the tolerance, the planner's choice vs the
    best candidate measured; an unreadable file says so; none: no section."""
    pol = {"ddp": {"predicted_s": 1.19, "measured_s": 1.1875, "error": 0.0021},
           "app_order": {"predicted_s": 1.15, "measured_s": 1.40, "error": -0.18},
           "shim_overlap": {"predicted_s": 0.88, "measured_s": 0.911, "error": -0.034}}
    d = {"rate": "200mbit", "hosts": 2, "iters": 6, "rounds": 3, "tolerance": 0.15, "planner_tolerance": 0.05,
         "machine": MACHINE, "profiles": {"resnet50": pol},
         "planner": {"resnet50": {"chosen": "layer_order L3", "chosen_s": 0.99, "best": "layer_order L4",
                                  "best_s": 0.90, "ratio": 1.1}, "vgg16": "garbage"}}
    write_results(tmp_path / "r", {"validate": d})
    lines = report.render_validate(report.load_one(str(tmp_path / "r" / "validate.json")))
    text = "\n".join(lines)
    assert "| ResNet-50 | plain DDP | 1190 ms | 1188 ms | +0.2% | met |" in lines
    assert "| ResNet-50 | application order (1 level) | 1150 ms | 1400 ms | -18.0% | **missed** by 0.03 |" in lines
    assert "| ResNet-50 | `layer_order L3` | 990 ms | `layer_order L4` | 900 ms | 1.10 | **missed** by 0.05 |" in lines
    assert "| VGG-16 | `-` | - | `-` | - | - | - |" in lines
    assert "median of 18 iterations per mode (3 interleaved rounds of 6)" in text and "2 cores, 24.0 GiB" in text
    (tmp_path / "r" / "validate.json").write_text("[")
    assert "unreadable (JSONDecodeError" in "\n".join(report.render_validate(report.load_one(
        str(tmp_path / "r" / "validate.json"))))
    assert report.render_validate(report.load_one(str(tmp_path / "nowhere.json"))) == []
    page = report.render_page(report.load(str(tmp_path / "r")), report.load_one(str(tmp_path / "r" / "validate.json")))
    assert "## Predicted vs measured" in page and page.endswith("\n")


def test_cli_errors(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text("no markers here\n")
    assert main(["--results", str(tmp_path), "--readme", str(path), "--img-dir", str(tmp_path / "img")]) == 2
    assert "exactly one" in capsys.readouterr().err
    assert main(["--readme", str(tmp_path / "missing.md")]) == 2


def test_overhead_and_classifier_rows(tmp_path):
    d = tmp_path / "results"
    write_results(d, {"shim-overhead": {"rate": "10gbit", "hosts": 2, "profile": "resnet50", "gradient_bytes": 2.04e6,
                                        "compute_nominal_s": 0.0785, "ddp_s": 0.100, "shim_s": 0.108,
                                        "shim_hook_s": 0.099, "ratio": 1.08, "ratio_hook": 0.99, "iters": 10,
                                        "rounds": 5, "reps": 50, "quick": False, "machine": MACHINE},
                      "classifier": {"rounds": 3, "seconds": 3.0, "cpus": 2, "kernel": "6.18.0",
                                     "results": [{"mechanism": "none", "n": None, "gbps_median": 2.0},
                                                 {"mechanism": "nft-map", "n": 1, "gbps_median": 1.9},
                                                 {"mechanism": "nft-map", "n": 10000, "gbps_median": 1.8},
                                                 {"mechanism": "u32-linear", "n": 10000, "gbps_median": 0.06}]}})
    section = render(report.load(str(d)))
    rows = {(r[0], r[1]): r for r in table_rows(section)}
    r = rows[("shim-overhead", "step time through the shim (overlap mode) vs plain DDP, link not limiting")]
    assert r[2:] == ["108 ms", "DDP 100 ms", "1.08", "<= 1.05", "**missed** by 0.03"]
    assert rows[("shim-overhead", "step time through the shim (hook mode) vs plain DDP, link not limiting")][6] == "met"
    r = rows[("classifier", "one CPU-bound stream through the nft map, N=10,000 flows vs N=1")]
    assert r[2] == "1.80 Gbit/s" and "u32 filters, N=10,000: 0.06 Gbit/s" in r[3] and r[4] == "0.95"
    line = next(x for x in section.splitlines() if x.startswith("- **shim-overhead**"))
    assert "10 Gbit/s" in line and "median of 50 iterations per mode (5 interleaved rounds of 10)" in line
    line = next(x for x in section.splitlines() if x.startswith("- **classifier**"))
    assert "2 cores, Linux 6.18.0" in line and "3 interleaved rounds of 3 s" in line
    written = report.write_plots(report.load(str(d)), str(tmp_path / "img"))
    assert set(written) == {"shim-overhead", "classifier"}
    assert all(os.path.getsize(p) > 1000 for p in written.values())


def test_bench_dispatch_stamps_machine(tmp_path, monkeypatch):
    """``python -m bench NAME --json FILE`` adds ``benchmark`` and ``machine`` to what the benchmark wrote."""
    import bench

    assert bench.json_path(["--quick", "--json", "x.json"]) == "x.json"
    assert bench.json_path(["--json=y.json"]) == "y.json" and bench.json_path(["--quick"]) is None
    assert {"jobs", "shim-overhead"} <= set(bench.BENCHMARKS)
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"machine": "a note", "x": 1}))
    assert bench.stamp(str(out), "control-plane")
    obj = json.loads(out.read_text())
    assert obj["benchmark"] == "control-plane" and obj["machine_note"] == "a note" and obj["x"] == 1
    assert obj["machine"]["cores"] >= 1 and obj["machine"]["kernel"]
    out.write_text(json.dumps({"machine": {"cpus": 2, "date": "then"}}))
    assert bench.stamp(str(out), "jobs")
    obj = json.loads(out.read_text())
    assert obj["machine"]["cpus"] == 2 and obj["machine"]["date"] == "then" and "torch" in obj["machine"]
    out.write_text("[1, 2]")
    assert not bench.stamp(str(out), "x")


def test_priority_dependency_bound_recorded_or_derived(tmp_path):
    """A file with ``lower_bound_dep_s`` is shown as recorded; an older one (scales, ranks and link rate only) gets
    the bound from ``bench.models.dependency_bound``; neither row has a target, so the counts do not change."""
    from bench.models import dependency_bound

    old = {"rate": "200mbit", "link_bps": 200_000_000, "ranks": 2, "hosts": 2, "iters": 8, "rounds": 3,
           "profiles": {"bert_base": {"param_scale": 23.0, "compute_scale": 3.55, "ddp_s": 1.127, "shim_s": 1.062,
                                      "app_order_s": 1.112, "lower_bound_s": 0.762},
                        "vgg16": {"ddp_s": 1.0, "shim_s": 0.8, "app_order_s": 1.0, "lower_bound_s": 0.738,
                                  "lower_bound_dep_s": 0.75}}}
    write_results(tmp_path / "r", {"priority": old})
    section = render(report.load(str(tmp_path / "r")))
    rows = {(r[0], r[1]): r for r in table_rows(section)}
    want = dependency_bound("bert_base", 2, 200e6, 23.0, 3.55)["lower_bound_dep_s"]
    assert 0.93 < want < 0.95
    r = rows[("priority", "BERT-base: shim vs dependency-aware lower bound")]
    assert r[2:] == ["1062 ms", f"dependency-aware lower bound {want * 1000:.0f} ms", f"{1.062 / want:.2f}",
                     "none (informational)", "-"]
    r = rows[("priority", "VGG-16: shim vs dependency-aware lower bound")]
    assert r[3:5] == ["dependency-aware lower bound 750 ms", "1.07"]
    assert "Targets missed (2 of 6 measured):" in section
    assert report.write_plots(report.load(str(tmp_path / "r")), str(tmp_path / "img")).keys() == {"priority"}
    # the bound itself: at least the plain one and the first layer's term, for every shipped profile
    for prof, (ps, cs) in {"resnet50": (5.0, 10.416), "vgg16": (30.0, 2.484), "bert_base": (23.0, 3.55)}.items():
        b = dependency_bound(prof, 2, 200e6, ps, cs)
        assert b["lower_bound_dep_s"] >= max(b["plain_s"], b["first_layer_s"]) - 1e-12


def test_busy_host_rows():
    """``busy_host`` (issue 15) adds two judged rows to control-plane's; a file without it adds none."""
    busy = {"sockets": 20000, "owners": 8, "window_s": 60, "agent_cpu_ratio": 0.07, "register_p99_ms": 3.2,
            "quiet_register_p99_ms": 2.9}
    cpu, p99 = report.rows_busy_host(busy)
    assert "20,000 sockets, 8 owners" in cpu.figure and cpu.ours == "7.0 % of a core" and cpu.missed
    assert p99.ours == "3.20 ms" and p99.result == "met"
    assert report.rows_busy_host(None) == [] and len(report.rows_control_plane({"busy_host": busy})) >= 2


def test_oversubscribed_row_judges_policies_not_fifos_control():
    def jobs(*pairs):
        return {"jobs": [{"jct_s": j, "fifo_jct_s": f} for j, f in pairs]}

    mix = {"name": "stagger4", "policies": {"fifo": jobs((10.0, 10.0), (8.0, 8.0)),
                                            "fifo_control": jobs((10.9, 10.0), (8.0, 8.0)),
                                            "static": jobs((10.3, 10.0), (7.0, 8.0))}}
    row = report._mix_oversub_row(mix, 1.05)
    assert row.ratio == "1.03" and "static, job 0" in row.alternatives


def test_a_held_phase_is_named_with_its_hold():
    """A held phase's name carries the mix's ``held_s`` (``--held-s``), 0.2 s where a file gives none (the files
    before ``--held-s``); other phases keep their names."""
    assert report._policy_name("shortest_held", {"held_s": 0.1}) == "shortest (held 0.1 s)"
    assert report._policy_name("static_held", {}) == "static (held 0.2 s)"
    assert report._policy_name("intensity_present", {"held_s": 0.1}) == "intensity (parts of jobs present)"


def test_the_average_row_names_the_floor_alone_gives():
    """The colliding mix's average row gives the average JCT alone against FIFO's: no policy can go below it (no
    job beats its time alone), so a target under it cannot be met on that mix."""
    def jobs(*jct):
        return {"jobs": [{"jct_s": j} for j in jct]}

    mix = {"name": "collide2", "policies": {"fifo": jobs(20.0, 20.0), "static": jobs(17.0, 17.0)},
           "solo": jobs(16.0, 16.8)}
    row = report._mix_avg_row(mix, "static", "average", 0.80)
    assert row.ratio == "0.85" and "alone 16.40 s (0.82x FIFO, a floor: no job beats its time alone)" in \
        row.alternatives, row.alternatives


def test_python_m_bench_alone_lists_the_benchmarks_on_stdout(capsys):
    """The README's ``python -m bench  # the list of benchmarks``: the list on stdout and exit 0 (it went to stderr
    with exit 2, as a usage error); an unknown name is still one (stderr, 2)."""
    import bench

    assert bench.main([]) == 0
    out = capsys.readouterr()
    assert "contention" in out.out and not out.err
    assert bench.main(["nosuch"]) == 2
    assert "unknown benchmark 'nosuch'" in capsys.readouterr().err


def _job(jct, fifo, solo, cpu, wait, rto):
    return {"job": "j", "jct_s": jct, "fifo_jct_s": fifo, "solo_jct_s": solo, "cpu_s": cpu, "cpu_wait_s": wait,
            "rto": rto}


# One mix, two jobs: FIFO, the recommended policy, alone and alone with the shim
JOBS_MIXES = {"rate": "50mbit", "iters": 12, "reps": 2, "recommended": "static", "mixes": [{
    "name": "m2", "fits_link": True, "collides": True, "recommended": "levels",
    "policies": {"fifo": {"jobs": [_job(10.0, 10.0, 8.0, 1.04, 0.96, 0), _job(12.0, 12.0, 9.0, 2.0, 1.0, 1)]},
                 "levels": {"jobs": [_job(8.8, 10.0, 7.5, 1.26, 1.5, 0.5), _job(13.2, 12.0, 9.0, 2.31, 1.0, 13.0)]}},
    "solo": {"jobs": [{"jct_s": 8.0, "cpu_s": 1.0, "cpu_wait_s": 0.5, "rto": 0},
                      {"jct_s": 9.0, "cpu_s": 1.0, "cpu_wait_s": 0.5, "rto": 0}]},
    "solo_shim": {"jobs": [{"jct_s": 7.5, "cpu_s": 1.44, "cpu_wait_s": None, "rto": 2.5},
                           {"jct_s": 9.5, "cpu_s": 1.2, "cpu_wait_s": 0.7, "rto": 0}]}}]}


def test_jobs_figures_table_from_mixes():
    """docs/jobs-measured.md's per-policy table: each job's JCT, CPU, run queue and RTO in job order; the average
    and largest per-job ratios (alone: the job's ``solo_jct_s``); ``*`` after the mix's recommended policy; the
    alone rows without ratios; ``-`` for a missing value."""
    lines = report.render_jobs_figures(JOBS_MIXES).splitlines()
    assert lines[0] == "Generated by `python -m bench.report` from `results/jobs.json` (do not edit by hand)."
    assert lines[2:4] == list(report.JOBS_FIGURES_HEADER)
    assert lines[4:] == [
        "| `m2` | fifo | 10.0 / 12.0 | 1.00 | 1.00 | 1.33 | 1.0 / 2.0 | 1.0 / 1.0 | 0 / 1 |",
        "| `m2` | levels * | 8.8 / 13.2 | 1.00 | 1.10 | 1.47 | 1.3 / 2.3 | 1.5 / 1.0 | 0.5 / 13 |",
        "| `m2` | alone | 8.0 / 9.0 |  |  |  | 1.0 / 1.0 | 0.5 / 0.5 | 0 / 0 |",
        "| `m2` | alone, shim | 7.5 / 9.5 |  |  |  | 1.4 / 1.2 | - / 0.7 | 2.5 / 0 |"]


def test_jobs_figures_block_is_written_and_checked(tmp_path, capsys):
    """A copy of docs/jobs-measured.md beside the README: its jobs-figures block is generated from jobs.json, a hand
    edit inside it makes ``--check`` fail naming the file, regenerating fixes it; nothing outside the block changes."""
    results = write_results(tmp_path / "results", dict(SAMPLES, jobs=JOBS_MIXES))
    path = readme(tmp_path)
    doc = tmp_path / "docs" / "jobs-measured.md"
    doc.parent.mkdir()
    original = (Path(__file__).resolve().parents[1] / "docs" / "jobs-measured.md").read_text()
    doc.write_text(original)
    args = ["--results", str(results), "--readme", str(path), "--img-dir", str(tmp_path / "img")]
    assert main(args) == 0 and main(args + ["--check"]) == 0
    text = doc.read_text()
    before, block, after = split_readme(text, report.FIGURES_BEGIN, report.FIGURES_END)
    assert block.strip() == report.render_jobs_figures(JOBS_MIXES)
    assert (before, after) == split_readme(original, report.FIGURES_BEGIN, report.FIGURES_END)[::2]
    doc.write_text(text.replace("| `m2` | levels * | 8.8 / 13.2 |", "| `m2` | levels * | 8.7 / 13.2 |"))
    capsys.readouterr()
    assert main(args + ["--check"]) == 1 and f"{doc}: differs" in capsys.readouterr().out
    assert main(args) == 0 and doc.read_text() == text and main(args + ["--check"]) == 0
    doc.write_text(original.replace(report.FIGURES_END, ""))   # a marker missing: an error, not a silent skip
    assert main(args + ["--check"]) == 2


def test_the_repositorys_generated_files_are_up_to_date(monkeypatch, capsys):
    """README.md's block, results/README.md, docs/jobs-measured.md's block and the plots are what results/*.json
    give (after replacing a JSON file, run ``make report``)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert report.build("results", "README.md", os.path.join("docs", "img"), check_only=True) == 0, \
        capsys.readouterr().out
