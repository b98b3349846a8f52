"""Rate schedules: parsing, arrivals per segment, windows and the settle time after each step."""

import random

import pytest

from mmstream.bench.config import BenchConfig, parse_rate_schedule
from mmstream.bench.results import Record
from mmstream.bench.timeline import settle, windows
from mmstream.bench.workloads import schedule, scheduled_offsets


def test_a_schedule_parses_and_refuses_what_is_not_rate_seconds():
    assert parse_rate_schedule("10:30, 90:60,10:60") == ((10.0, 30.0), (90.0, 60.0), (10.0, 60.0))
    for bad in ("10", "10:0", "-1:5", "a:b", ""):
        with pytest.raises(ValueError):
            parse_rate_schedule(bad)
    with pytest.raises(ValueError, match="replaces --rates"):
        BenchConfig(rates=(5.0,), rate_schedule=((10.0, 5.0),))


def test_arrivals_follow_each_segment_s_rate_and_the_run_is_labelled_by_its_mean():
    segs = ((10.0, 100.0), (90.0, 100.0))
    offsets = scheduled_offsets(segs, random.Random(1))
    first, second = sum(t < 100 for t in offsets), sum(t >= 100 for t in offsets)
    assert 800 < first < 1200 and 8000 < second < 10000 and offsets == sorted(offsets)
    cfg = BenchConfig(rate_schedule=segs, duration_s=200.0)
    assert cfg.sweep == (50.0,)
    got, requests = schedule(cfg, cfg.sweep[0])
    assert len(got) == len(requests) and max(got) < 200


def rec(at_s: float, ms: float | None, outcome: str | None = "ok", parts=("text",)) -> Record:
    return Record("text", parts, at_s * 1000, None if ms is None else at_s * 1000 + ms, outcome)


def test_windows_report_offered_rate_outcomes_and_text_percentiles():
    records = [rec(0.5, 100), rec(1.0, 300), rec(6.0, 900), rec(6.5, None, None), rec(7.0, 50, "overloaded"),
               rec(7.5, 2000, parts=("text", "image"))]
    w0, w1 = windows(records, start_ms=0.0, width_s=5.0)
    assert (w0["t"], w0["offered"], w0["outcomes"], w0["text_p50_ms"], w0["text_p99_ms"]) == (0.0, 0.4, {"ok": 2}, 100.0, 300.0)
    assert w1["outcomes"] == {"ok": 2, "lost": 1, "overloaded": 1} and w1["text_p99_ms"] == 900.0  # the image request apart
    assert (w0["p50_ms"], w0["p99_ms"], w1["p50_ms"], w1["p99_ms"]) == (100.0, 300.0, 900.0, 2000.0)  # every answered one


def test_settle_is_the_time_from_a_step_until_p99_stays_under_the_bound():
    wins = [{"t": t, "text_p99_ms": p} for t, p in [(0, 100), (5, 100), (10, 900), (15, 700), (20, 300), (25, 200),
                                                    (30, 800), (35, 100)]]
    # steps at 0 (fine from the start), 10 (back under at 20: 10 s), 30 (back under at 35)
    assert settle(wins, [0, 10, 30]) == [0.0, 10.0, 5.0]
    assert settle([{"t": 0, "text_p99_ms": 900}], [0]) == [None]
