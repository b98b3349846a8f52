"""`mmstream.report`: report.md states the JSON's numbers, and the plots are real PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmstream.report import PLOTS, BenchSchemaError, fmt, write_report
from tests.unit.mmstream.test_bench import synthetic_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(md: str, header_start: str) -> list[list[str]]:
    """Cells of the rows of every table whose header line starts with ``header_start``."""
    rows, inside = [], False
    for line in md.splitlines():
        if line.startswith(header_start):
            inside = True
            continue
        if inside and line.startswith("|---"):
            continue
        if inside and line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        else:
            inside = False
    return rows


def _png_ok(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 2000 and data.startswith(PNG_MAGIC)


def test_report_numbers_match_the_json(tmp_path: Path) -> None:
    run = synthetic_run()
    md = write_report([run], tmp_path).read_text()
    e2e_rows = {r[0]: r for r in _rows(md, "| kind | n | p50")}
    assert set(e2e_rows) == set(run["latency_ms"])
    for kind, lat in run["latency_ms"].items():
        e, o = lat["e2e"], run["overhead_ms"][kind]
        assert e2e_rows[kind][1:] == [str(e["count"]), fmt(e["p50"]), fmt(e["p95"]), fmt(e["p99"]),
                                      fmt(o["floor_ms"]), fmt(o["total"]["p50"]), fmt(o["total"]["p95"])]
    stage_rows = {(r[0], r[1]): r for r in _rows(md, "| kind | stage |")}
    for kind, lat in run["latency_ms"].items():
        for stage, st in lat["stages"].items():
            assert stage_rows[(kind, stage)][2:6] == [fmt(st["queued"]["p50"]), fmt(st["queued"]["p95"]),
                                                      fmt(st["service"]["p50"]), fmt(st["service"]["p95"])]
    assert f"CPU per request: {fmt(run['cpu']['per_request_ms'])} ms" in md
    assert f"sent {run['requests']['sent']}, ok {run['requests']['ok']}" in md


def test_single_run_writes_cdf_and_stage_plots(tmp_path: Path) -> None:
    md = write_report([synthetic_run()], tmp_path).read_text()
    for name in ("latency_cdf.png", "stages.png"):
        assert _png_ok(tmp_path / name) and f"]({name})" in md
    assert not (tmp_path / "p99_vs_throughput.png").exists()  # one point is no curve


def test_compare_two_sweeps_on_the_same_axes(tmp_path: Path) -> None:
    pipe = {"mode": "pipeline", "workload": "text", "runs": [synthetic_run("pipeline", r, seed=1) for r in (5, 10)]}
    mono = {"mode": "monolithic", "workload": "text",
            "runs": [synthetic_run("monolithic", r, seed=2) for r in (5, 10, 20)]}
    md = write_report([pipe, mono], tmp_path).read_text()
    for name in PLOTS:
        assert _png_ok(tmp_path / name)
    rows = _rows(md, "| rate (req/s) | kind |")
    assert {r[0] for r in rows} == {fmt(5), fmt(10)}  # only rates both inputs have
    five = next(r for r in rows if r[0] == fmt(5) and r[1] == "text")
    e = pipe["runs"][0]["latency_ms"]["text"]["e2e"]
    assert five[2] == f"{fmt(e['p50'])} / {fmt(e['p95'])} / {fmt(e['p99'])}"


def test_report_refuses_an_invalid_input(tmp_path: Path) -> None:
    run = synthetic_run()
    run.pop("floor_ms")
    with pytest.raises(BenchSchemaError):
        write_report([run], tmp_path)
    json.dumps(synthetic_run())  # the JSON really is JSON


def test_bench_compare_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from argparse import Namespace

    from mmstream.bench import cli_main

    a, b, bad = tmp_path / "pipe.json", tmp_path / "mono.json", tmp_path / "bad.json"
    a.write_text(json.dumps(synthetic_run("pipeline")))
    b.write_text(json.dumps(synthetic_run("monolithic", seed=3)))
    bad.write_text(json.dumps({"mode": "pipeline"}))
    out = tmp_path / "report"
    assert cli_main(Namespace(action="compare", inputs=[a, b], report=out), None) == 0
    assert "| pipeline p50 / p95 / p99 (ms) | monolithic p50 / p95 / p99 (ms) |" in (out / "report.md").read_text()
    assert cli_main(Namespace(action="compare", inputs=[a, bad], report=out), None) == 2
    assert "schema" in capsys.readouterr().err


def test_p99_curve_is_one_line_per_mode_across_input_files() -> None:
    from mmstream.report import p99_lines

    single = [[synthetic_run("pipeline", r, seed=r)] for r in (20, 5, 10)]  # three files, one rate each
    mono = [[synthetic_run("monolithic", r, seed=r) for r in (10, 5)]]
    lines = p99_lines(single + mono, ["a", "b", "c", "d"])
    kinds = set(single[0][0]["latency_ms"])
    assert set(lines) == {f"{mode}: {kind}" for mode in ("pipeline", "monolithic") for kind in kinds}
    for kind in kinds:
        pts = lines[f"pipeline: {kind}"]
        assert len(pts) == 3  # one line through the three files' points, not three points
        rates = [r["achieved_rate"] for r in sorted((f[0] for f in single), key=lambda r: r["config"]["rate"])]
        assert [x for x, _ in pts] == rates


def test_one_mode_with_two_configs_keeps_two_lines() -> None:
    from mmstream.report import p99_lines

    on = [synthetic_run("pipeline", r, seed=r) for r in (5, 10)]
    off = [synthetic_run("pipeline", r, seed=r) for r in (5, 10)]
    for run in off:
        run["config"]["levers_off"] = ["cache"]
    lines = p99_lines([on, off], ["with cache", "no cache"])
    assert {label.split(":")[0] for label in lines} == {"with cache", "no cache"}


def test_log_axis_where_values_span_widely() -> None:
    from mmstream.report import axis_scale

    assert axis_scale([1.0, 2.0, 15.0]) == "linear"
    assert axis_scale([0.5, 3.0, 900.0]) == "log"
    assert axis_scale([0.0, 5.0]) == "linear" and axis_scale([]) == "linear"


def test_table_headers_carry_units(tmp_path: Path) -> None:
    md = write_report([synthetic_run()], tmp_path).read_text()
    assert "| kind | n | p50 (ms) | p95 (ms) | p99 (ms) | floor (ms) |" in md
    assert "| kind | stage | queued p50 (ms) |" in md


def test_a_missing_matplotlib_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    import builtins

    from mmstream.report import ReportError

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ReportError, match=r"pip install -e '\.\[report\]'"):
        write_report([synthetic_run()], tmp_path)


def test_a_run_with_a_rate_schedule_gets_the_timeline_plot(tmp_path: Path) -> None:
    run = synthetic_run()
    assert not write_report([run], tmp_path / "plain").read_text().count("timeline.png")
    run["timeline"] = {"schedule": [[10, 10], [90, 10]], "text_p99_settled_s": [0.0, None],
                       "windows": [{"t": 0.0, "offered": 10.0, "outcomes": {"ok": 50}, "text_p50_ms": 20.0, "text_p99_ms": 80.0},
                                   {"t": 5.0, "offered": 90.0, "outcomes": {"ok": 400, "overloaded": 50},
                                    "text_p50_ms": 300.0, "text_p99_ms": None}],
                       "replicas": [{"t": 0.0, "router": 1, "encode.text": 1}, {"t": 6.0, "router": 1, "encode.text": 2}]}
    md = write_report([run], tmp_path).read_text()
    assert _png_ok(tmp_path / "timeline.png") and "](timeline.png)" in md
