"""`mmstream top`'s pure parts: histogram quantiles, stage and topic rows, the frame."""

from __future__ import annotations

import math

from rich.console import Console

from mmstream.top import (
    frame_json,
    BATCH,
    QUEUE,
    SERVICE,
    Sample,
    WorkerSample,
    parse_histograms,
    quantile,
    render,
    stage_rows,
    topic_rows,
)
from streams.observe.lagmon import LagRow

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    b = {0.01: 0.0, 0.02: 10.0, INF: 10.0}
    assert quantile(0.5, b) == 0.015
    assert quantile(0.5, {0.01: 0.0, INF: 0.0}) is None
    assert quantile(0.99, {0.01: 0.0, 0.02: 1.0, INF: 10.0}) == 0.02  # in +Inf: highest finite bound
    assert quantile(0.5, {1: 3.0, 2: 4.0, INF: 4.0}, low=1.0) == 1.0


def test_parse_histograms_sums_label_sets() -> None:
    text = "\n".join([
        "# TYPE mmstream_stage_service_seconds histogram",
        'mmstream_stage_service_seconds_bucket{lane="rt",le="0.01",modality="text",stage="encode.text"} 2.0',
        'mmstream_stage_service_seconds_bucket{lane="rt",le="+Inf",modality="text",stage="encode.text"} 3.0',
        'mmstream_stage_service_seconds_bucket{lane="bulk",le="0.01",modality="text",stage="encode.text"} 1.0',
        'mmstream_stage_service_seconds_bucket{lane="bulk",le="+Inf",modality="text",stage="encode.text"} 1.0',
        'mmstream_stage_service_seconds_count{lane="bulk",modality="text",stage="encode.text"} 1.0',
        'mmstream_stage_service_seconds_sum{lane="bulk",modality="text",stage="encode.text"} 0.005',
    ]) + "\n"
    assert parse_histograms(text)[SERVICE] == {0.01: 3.0, INF: 4.0}


def _ws(stage: str, n: float, slow: bool = False) -> WorkerSample:
    bound = 1.0 if slow else 0.01
    h = {QUEUE: {bound: n, INF: n}, SERVICE: {bound: n, INF: n}, BATCH: {1: n, 2: n, INF: n}}
    return WorkerSample(stage, 1, 1, h, scraped=True)


def test_stage_rows_use_the_interval_and_mark_the_slowest() -> None:
    before = Sample(10.0, {"router": _ws("router", 10), "encode.text": _ws("encode.text", 10, slow=True),
                           "lagmon": WorkerSample("lagmon", 1, 1, {}, True)}, [])
    now = Sample(12.0, {"router": _ws("router", 30), "encode.text": _ws("encode.text", 10, slow=True),
                        "lagmon": WorkerSample("lagmon", 1, 1, {}, True)}, [])
    rows = {r.stage: r for r in stage_rows(now, before)}
    assert set(rows) == {"router", "encode.text", "lagmon"}
    assert rows["router"].window == "2s" and rows["router"].items_per_s == 10.0
    assert rows["encode.text"].window == "all"  # idle in the interval: cumulative
    assert rows["encode.text"].slowest and not rows["router"].slowest
    assert rows["lagmon"].service_p50_ms is None and rows["router"].batch_p50 == 1.0


def test_topic_rows_rates_from_offset_deltas() -> None:
    def lag(end: int, committed: int) -> list[LagRow]:
        return [LagRow("mm-router", "mm.ingress.rt", 0, committed, end, end - committed),
                LagRow("mm-router", "mm.ingress.rt", 1, committed, end, end - committed)]

    rows = topic_rows(Sample(11.0, {}, lag(120, 100)), Sample(10.0, {}, lag(100, 90)))
    assert rows == [rows[0]] and rows[0].topic == "mm.ingress.rt"
    assert (rows[0].lag, rows[0].in_per_s, rows[0].out_per_s) == (40, 40.0, 20.0)
    assert topic_rows(Sample(1.0, {}, lag(5, 5)), None)[0].in_per_s is None


def test_frame_shows_every_stage_and_topic() -> None:
    now = Sample(2.0, {s: _ws(s, 5) for s in ("router", "assembler", "encode.text")},
                 [LagRow("mm-router", "mm.ingress.rt", 0, 3, 4, 1)])
    console = Console(record=True, width=160)
    console.print(render(now, None, "mm"))
    text = console.export_text()
    for word in ("router", "assembler", "encode.text", "mm.ingress.rt"):
        assert word in text


def _busy_frame() -> tuple[Sample, Sample]:
    stages = ("router", "assembler", "encode.text", "encode.image", "encode.audio", "encode.video",
              "encode.any", "generate", "lagmon")
    topics = [f"mm.encode.{m}.{lane}" for m in ("text", "image", "audio", "video") for lane in ("rt", "bulk")]
    before = Sample(1.0, {s: _ws(s, 5) for s in stages}, [LagRow("g", t, 0, 0, 10, 10) for t in topics])
    slow = {QUEUE: {30.0: 99999, INF: 99999}, SERVICE: {30.0: 99999, INF: 99999}, BATCH: {64: 99999, INF: 99999}}
    now = Sample(2.0, {**{s: _ws(s, 50) for s in stages}, "encode.video": WorkerSample("encode.video", 12, 10, slow, True)},
                 [LagRow("g", t, 0, 5, 123456, 123451) for t in topics])
    return now, before


def test_frame_fits_80_columns_without_wrapping_a_cell() -> None:
    now, before = _busy_frame()
    console = Console(record=True, width=80, force_terminal=False)
    console.print(render(now, before, "mm"))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in ("encode.image", "encode.video", "mm.encode.video.bulk", "123451"):
        assert any(name in line for line in text.splitlines()), f"{name} wrapped or missing"
    rows = [line for line in text.splitlines() if line.lstrip().startswith(("router", "encode.", "assembler", "generate"))]
    assert len(rows) == 8, text  # one line per stage: no cell spilled onto a second line


def test_json_frame_is_one_document_with_the_same_rows() -> None:
    import json

    now, before = _busy_frame()
    line = frame_json(now, before, "mm", 1700000000.0)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["prefix"] == "mm" and doc["time"] == 1700000000.0
    assert {s["stage"] for s in doc["stages"]} >= {"router", "encode.video"}
    assert {t["topic"] for t in doc["topics"]} >= {"mm.encode.text.rt"}
    video = next(s for s in doc["stages"] if s["stage"] == "encode.video")
    assert video["slowest"] is True and video["workers"] == "10/12"
