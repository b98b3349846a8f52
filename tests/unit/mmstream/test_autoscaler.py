"""The local scaler's pure parts: signals from lag rows and load reports, rules from settings,
and what `mmstream scale` reads back."""

import asyncio
import os
import time
from pathlib import Path

import pytest

from mmstream.autoscaler import BoxCpu, lane_of, rules, signals
from mmstream.scale_cli import last_decisions
from schemas.settings import Settings
from streams.observe.lagmon import LagRow


def test_signals_sum_lag_per_lane_and_fresh_queued_work_per_pool():
    rows = [LagRow("mm-encode-text", "mm.encode.text.rt", 0, 5, 9, 4), LagRow("mm-encode-text", "mm.encode.text.rt", 1, 0, 3, 3),
            LagRow("mm-encode-text", "mm.encode.text.bulk", 0, 0, 7, 7), LagRow("mm-other", "mm.encode.text.rt", 0, 0, 9, 9)]
    loads = {"encode.text-0": {"stage": "encode.text", "at": 10_000, "queued_ms": 120.0, "running_ms": 15.0,
                               "items": 9},
             "encode.text-2": {"stage": "encode.text", "at": 10_000, "queued_ms": 30.0},  # no running_ms: older worker
             "encode.text-1": {"stage": "encode.text", "at": 10_000 - 5_000, "queued_ms": 900.0},  # stale: gone
             "x": {"stage": "encode.text"}}  # torn: skipped
    (text, audio) = signals("mm", ["encode.text", "encode.audio"], {"encode.text": 2}, rows, loads, now_ms=10_500)
    assert (text.replicas, dict(text.lag), text.queued_ms, text.running_ms) == (2, {"rt": 7, "bulk": 7}, 150.0,
                                                                                (15.0, 0.0))
    assert text.items is None  # encode.text-2 did not say: no cap
    assert (audio.replicas, dict(audio.lag), audio.queued_ms, audio.running_ms, audio.items) == (0, {}, 0.0, (), None)
    loads["encode.text-2"]["items"] = 1
    (text,) = signals("mm", ["encode.text"], {"encode.text": 2}, rows, loads, now_ms=10_500)
    assert text.items == 10


def test_a_source_that_failed_adds_nothing():
    (text,) = signals("mm", ["encode.text"], {"encode.text": 1}, None, None, now_ms=0)
    assert (dict(text.lag), text.queued_ms) == ({}, 0.0)


def test_box_cpu_reads_idle_cores_between_two_reads_of_proc_stat(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    box = BoxCpu(2, str(stat))
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    assert box.idle_cores() is None  # one read: no interval yet
    stat.write_text("cpu  250 0 100 850 0 0 0 0 0 0\n")  # 150 busy, 50 idle of 200: 1.5 cores busy
    assert box.idle_cores() == pytest.approx(0.5)
    stat.write_text("cpu  250 0 100 950 50 0 0 0 0 0\n")  # all idle (iowait counts idle)
    assert box.idle_cores() == pytest.approx(2.0)
    assert BoxCpu(1, str(stat)).idle_cores() is None
    stat.write_text("cpu  450 0 100 950 50 0 0 0 0 0\n")
    one = BoxCpu(1, str(stat))  # a scaler given one core of the two: what is busy counts against it
    one._last = (1350.0, 1000.0)
    assert one.idle_cores() == 0.0
    assert BoxCpu(2, str(tmp_path / "missing")).idle_cores() is None


def test_box_cpu_reading_has_each_pools_used_cores():
    box = BoxCpu(2)
    assert box.reading([("encode.audio", os.getpid())]) is None  # the first read: no interval yet
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    got = box.reading([("encode.audio", os.getpid()), ("encode.text", 2 ** 22 + 12345)])
    assert got is not None and 0.3 < got.used_cores["encode.audio"] <= 1.2  # this process spun most of it
    assert "encode.text" not in got.used_cores and 0.0 <= got.idle_cores <= 2.0


def test_lanes_of_topics():
    assert [lane_of(t) for t in ("mm.encode.text.rt", "mm.generate.bulk", "mm.ingress.rt.acme", "mm.vectors")] == \
        ["rt", "bulk", "rt", None]


def test_rules_follow_the_settings_and_the_engines_threads():
    s = Settings.from_env({"MMSTREAM_AUTOSCALE_POOLS": "encode.text=1:3,generate=0:2,router=1:2",
                           "MMSTREAM_AUTOSCALE_CPU_CORES": "6", "MMSTREAM_ENCODER_INTRA_OP_THREADS": "2",
                           "MMSTREAM_GENERATOR_THREADS": "0"})
    r = rules(s)
    assert (r["encode.text"].min, r["encode.text"].max, r["encode.text"].threads) == (1, 3, 2)
    assert (r["generate"].min, r["generate"].threads, dict(r["generate"].lag_per_replica)) == (0, 6, {"rt": 8, "bulk": 32})
    assert r["router"].threads == 1 and dict(r["router"].lag_per_replica) == {"rt": 50, "bulk": 200}


def test_scale_reads_the_last_decisions_and_skips_a_torn_line(tmp_path: Path):
    log = tmp_path / "autoscale.jsonl"
    log.write_text('{"stage": "a", "to": 1}\n{"stage": "b", "to": 2}\n{"stage": "c"')
    assert [d["stage"] for d in last_decisions(log, 2)] == ["b"]
    assert [d["stage"] for d in last_decisions(log, 10)] == ["a", "b"]
    assert last_decisions(tmp_path / "none.jsonl", 5) == []


async def test_the_scaler_decides_nothing_on_a_tick_without_lag_and_applies_and_logs_what_it_decides(tmp_path: Path):
    import json
    import os

    from mmstream.autoscaler import LocalScaler

    settings = Settings.from_env({"MMSTREAM_LOCAL_STATE_DIR": str(tmp_path), "MMSTREAM_AUTOSCALE_POOLS": "encode.audio=0:2",
                                  "MMSTREAM_AUTOSCALE_IDLE_S": "0"})
    scaler = LocalScaler(settings)
    sup = scaler.supervisor
    sup.dir.mkdir(parents=True)
    (sup.dir / "encode.audio-0.json").write_text(json.dumps(  # a live process stands in for the replica
        {"stage": "encode.audio", "replica": 0, "pid": os.getpid(), "log_file": str(tmp_path / "a.log"),
         "started_at": 0.0}))
    stopped = []
    sup.stop_beyond = lambda stage, count: stopped.append((stage, count))  # never signal the test's own pid
    sup.write_targets = lambda workers=None: None

    async def no_lag():
        return None

    async def no_loads():
        return {}

    scaler._lag, scaler._loads = no_lag, no_loads
    assert await scaler.tick() == [] and stopped == []  # the broker could not be read: an idle-looking pool stays

    async def zero_lag():
        return [LagRow("mm-encode-audio", "mm.encode.audio.rt", 0, 3, 3, 0)]

    scaler._lag = zero_lag
    (d,) = await scaler.tick()
    await asyncio.gather(*scaler._busy.values())
    assert (d.stage, d.target, d.reason) == ("encode.audio", 0, "idle") and stopped == [("encode.audio", 0)]
    (line,) = [json.loads(x) for x in (sup.dir / "autoscale.jsonl").read_text().splitlines()]
    assert line["stage"] == "encode.audio" and line["to"] == 0 and line["held"] is False
    await scaler.reader.close()
    await scaler.redis.aclose()
