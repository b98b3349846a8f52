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
    rows = _rows(md, "| rate | kind |")
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
    assert "| pipeline p50 / p95 / p99 | monolithic p50 / p95 / p99 |" in (out / "report.md").read_text()
    assert cli_main(Namespace(action="compare", inputs=[a, bad], report=out), None) == 2
    assert "schema" in capsys.readouterr().err
