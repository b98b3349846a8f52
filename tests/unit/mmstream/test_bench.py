"""The bench's pure parts: schedules, the monolith's batching (the pipeline's batcher on one
lane), run reports."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from mmstream.bench import (
    BenchConfig,
    CpuTally,
    Record,
    arrival_offsets,
    build_run,
    overhead,
    parse_rates,
    proc_cpu_s,
    proc_peak_rss_mb,
    request_kind,
    schedule,
)
from mmstream.bench.results import return_ms
from mmstream.bench.run import _pipeline_record
from mmstream.monolith import Monolith, Outcome
from mmstream.report import RUN_SCHEMA, BenchSchemaError, schema_problems, validate
from schemas.events import Event, EventKind
from schemas.request import Lane, Modality, Part, Request
from streams.sdk.client import Submission
from streams.policies.batching import BatchLimits, Wait

# -- the monolith, with stand-in engines --------------------------------------------------------

class _FakeText:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def run_batch(self, texts):
        self.calls.append(len(texts))
        return [[0.0] for _ in texts]


class _FakeImage(_FakeText):
    def run_batch(self, datas):
        self.calls.append(len(datas))
        return [ValueError("bad image") if d == b"bad" else [0.0] for d, _ in datas]


class _FakeEngines:
    def __init__(self) -> None:
        self.text, self.image = _FakeText(), _FakeImage()


# -- the monolith's batching: the pipeline's batcher, one lane, unit costs -----------------------

class _Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _request(i: int, lane: str = "rt") -> Request:
    return Request(id=f"r{i}", parts=(Part(Modality.TEXT, text=f"text {i}"),), lane=Lane(lane))


def test_monolith_waits_for_company_then_runs_what_it_has() -> None:
    clock = _Clock(1.000)
    mono = Monolith(_FakeEngines(), BatchLimits(max_batch_size=4, max_wait_s=0.010), clock=clock)
    assert mono.next_batch() is None
    first = mono.submit(_request(0))
    clock.now = 1.002
    second = mono.submit(_request(1))
    clock.now = 1.005
    assert mono.next_batch() == Wait(1.010)
    clock.now = 1.010
    assert mono.next_batch() == [first, second]
    assert mono.next_batch() is None and not mono.queue


def test_monolith_runs_a_full_batch_at_once() -> None:
    mono = Monolith(_FakeEngines(), BatchLimits(max_batch_size=3, max_wait_s=10.0), clock=_Clock(1.0))
    outcomes = [mono.submit(_request(i)) for i in range(5)]
    assert mono.next_batch() == outcomes[:3]
    assert mono.next_batch() == Wait(11.0)  # two left: they wait for company


@hsettings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0, 0.02), min_size=1, max_size=60),
       size=st.integers(1, 8), wait=st.floats(0, 0.01), step=st.floats(0.0005, 0.01),
       lanes=st.lists(st.sampled_from(["rt", "bulk"]), min_size=60, max_size=60))
def test_monolith_serves_everyone_once_in_order_within_limits(gaps: list[float], size: int, wait: float,
                                                             step: float, lanes: list[str]) -> None:
    """Driving the monolith's batching over a clock: every request is taken exactly once,
    in arrival order whatever its lane (one FIFO), no batch exceeds the size, and nobody
    waits past the wait without a batch."""
    clock = _Clock()
    mono = Monolith(_FakeEngines(), BatchLimits(size, wait), clock=clock)
    arrivals, t = [], 0.0
    for g in gaps:
        t += g
        arrivals.append(t)
    submitted: list[Outcome] = []
    served: list[Outcome] = []
    while len(served) < len(arrivals):
        while len(submitted) < len(arrivals) and arrivals[len(submitted)] <= clock.now:
            submitted.append(mono.submit(_request(len(submitted), lanes[len(submitted)])))
        oldest = mono.queue[0].enqueued_at if mono.queue else None
        decision = mono.next_batch()
        if isinstance(decision, list):
            assert 1 <= len(decision) <= size
            assert len(decision) == size or clock.now >= oldest + wait
            served += decision
            continue
        if isinstance(decision, Wait):
            assert decision.until > clock.now and len(mono.queue) < size
        clock.now += step
    assert [id(o) for o in served] == [id(o) for o in submitted]


async def test_the_monolith_loop_runs_what_the_batcher_decides() -> None:
    """Seven requests at once, batches of three: 3 + 3 at once, the last one after the wait."""
    engines = _FakeEngines()
    mono = Monolith(engines, BatchLimits(max_batch_size=3, max_wait_s=0.05))
    server = asyncio.create_task(mono.run())
    outcomes = [mono.submit(_request(i, ("rt", "bulk")[i % 2])) for i in range(7)]
    mono.close()
    await asyncio.wait_for(server, 5)
    assert mono.batch_sizes == engines.text.calls == [3, 3, 1]
    assert [o.batch_size for o in outcomes] == [3, 3, 3, 3, 3, 3, 1]
    last = outcomes[-1]
    assert last.finished_at_ms - last.arrived_at_ms >= 50.0  # it waited for company that never came


async def test_monolith_answers_every_request_with_one_engine_call_per_modality_and_batch() -> None:
    cfg = BenchConfig(workload="mixed", rate=50, duration_s=0.5, seed=3)
    pytest.importorskip("skimage")
    _, requests = schedule(cfg, 50)
    engines = _FakeEngines()
    mono = Monolith(engines, BatchLimits(max_batch_size=len(requests), max_wait_s=0.05))
    server = asyncio.create_task(mono.run())
    for r in requests:
        mono.submit(r)
    mono.close()
    await asyncio.wait_for(server, 5)
    assert engines.text.calls == [len(requests)]  # one batch, all texts in one call
    assert all(o.finished_at_ms is not None and o.batch_size == len(requests) for o in mono.outcomes)
    order = {Modality.TEXT: "encode.text", Modality.IMAGE: "encode.image", Modality.VIDEO: "encode.video",
             Modality.AUDIO: "encode.audio"}
    for o in mono.outcomes:
        stages = [s["stage"] for s in o.spans]
        present = {p.modality for p in o.request.parts}
        assert stages == [stage for m, stage in order.items() if m in present]
        assert sum(s["queued_ms"] + s["service_ms"] for s in o.spans) <= o.e2e_ms + 0.01


# -- schedules and workloads ----------------------------------------------------------------------

def test_the_same_seed_gives_the_same_schedule_to_both_modes() -> None:
    a = schedule(BenchConfig(mode="pipeline", seed=7, duration_s=3), 20)
    b = schedule(BenchConfig(mode="monolithic", seed=7, duration_s=3), 20)
    assert a[0] == b[0]
    assert [r.parts for r in a[1]] == [r.parts for r in b[1]]
    assert schedule(BenchConfig(seed=8, duration_s=3), 20)[0] != a[0]


def test_arrivals_are_poisson_at_the_rate() -> None:
    offsets = arrival_offsets(100, 50, random.Random(1))
    assert abs(len(offsets) / 50 - 100) < 5
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] < 50


def test_mixed_workload_shares_and_deterministic_images() -> None:
    pytest.importorskip("skimage")
    from mmstream.bench import MIXED_KINDS

    _, requests = schedule(BenchConfig(workload="mixed", seed=1, duration_s=8), 100)
    kinds = [request_kind(r) for r in requests]
    n = len(kinds)
    for kind, share in MIXED_KINDS:
        assert abs(kinds.count(kind) / n - share) < 0.05, kind
    _, again = schedule(BenchConfig(workload="mixed", seed=1, duration_s=8), 100)
    assert [r.parts for r in again] == [r.parts for r in requests]
    images = [p.data for r in requests for p in r.parts if p.modality == Modality.IMAGE]
    assert all(d[:2] == b"\xff\xd8" for d in images)
    assert len(set(images)) == len(images)  # each its own bytes: a content-keyed cache cannot answer


def test_config_and_rates_are_checked() -> None:
    assert parse_rates("5, 10,20") == (5.0, 10.0, 20.0)
    assert BenchConfig(rates=(1.0, 2.0)).sweep == (1.0, 2.0) and BenchConfig(rate=3).sweep == (3.0,)
    for bad in ("", "5,-1", "x"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    with pytest.raises(ValueError):
        BenchConfig(mode="batchy")
    with pytest.raises(ValueError):
        BenchConfig(workload="video")


def test_process_accounting_reads_proc() -> None:
    sum(i * i for i in range(200_000))
    assert proc_cpu_s(os.getpid()) > 0
    assert proc_peak_rss_mb(os.getpid()) > 1
    assert proc_cpu_s(2 ** 22 + 12345) is None


def test_cpu_tally_counts_processes_that_start_or_stop_during_the_run() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    tally = CpuTally([("me", os.getpid())])
    sum(i * i for i in range(300_000))
    child = subprocess.Popen([sys.executable, "-c", burn])  # a replica started after the run began
    try:
        deadline = time.monotonic() + 20
        while (proc_cpu_s(child.pid) or 0.0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tally.read([("me", os.getpid()), ("encode.audio[1]", child.pid)])
    finally:
        child.kill()
        child.wait()
    tally.read([("me", os.getpid()), ("encode.audio[1]", child.pid)])  # gone now: its last read stands
    got = tally.per_name()
    assert got["encode.audio[1]"] >= 0.3  # counted from zero, not dropped for missing the first read
    assert 0 < got["me"] < proc_cpu_s(os.getpid())  # from the tally's first read, not since exec


# -- one run's JSON --------------------------------------------------------------------------------

def synthetic_run(mode: str = "pipeline", rate: float = 10.0, n: int = 50, seed: int = 0) -> dict:
    """A run JSON built by the real report code from made-up records."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        kind = ("text", "text+image", "text+2images")[i % 3]
        parts = ("text",) + ("image",) * ("text", "text+image", "text+2images").index(kind)
        q, s = rng.uniform(0, 5), rng.uniform(4, 9)
        sent = 1000.0 + i * 100
        stages = [{"stage": "route", "queued_ms": 1.0, "service_ms": 0.1},
                  {"stage": "encode.text", "queued_ms": q, "service_ms": s}]
        records.append(Record(kind, parts, sent, sent + 1.1 + q + s + 2.0, "ok", stages))
    records.append(Record("text", ("text",), 9000.0, 9010.0, "deadline_exceeded", cause="deadline_exceeded"))
    records.append(Record("text", ("text",), 9050.0, 9060.0, "overloaded", retry_after_ms=600, cause="encoder_wait"))
    records.append(Record("text", ("text",), 9100.0))
    cpu = {"scope": "test", "total_s": 1.0, "per_request_ms": 20.0, "per_process_s": {"x": 1.0}}
    run = build_run(mode, BenchConfig(mode=mode, rate=rate), rate, records, 5.0, cpu, {"x": 100.0, "y": None})
    run["floor_ms"] = {"encode.text": 4.0, "encode.image": 8.0}
    run["overhead_ms"] = overhead(run["latency_ms"], run["floor_ms"])
    return run


def test_a_run_validates_and_counts_outcomes() -> None:
    run = synthetic_run()
    assert validate(run) == [run]
    assert run["requests"] == {"sent": 53, "ok": 50, "errors": {"deadline_exceeded": 1, "overloaded": 1}, "lost": 1,
                               "by_cause": {"deadline_exceeded": 1, "encoder_wait": 1}}
    assert set(run["latency_ms"]) == {"text", "text+image", "text+2images"}
    assert run["throughput"]["parts_per_s"]["image"] > 0
    o = run["overhead_ms"]["text+2images"]
    assert o["floor_ms"] == 4.0 + 2 * 8.0
    assert o["total"]["p50"] == pytest.approx(run["latency_ms"]["text+2images"]["e2e"]["p50"] - 20.0, abs=1e-3)
    st = run["latency_ms"]["text"]["stages"]["encode.text"]
    assert run["overhead_ms"]["text"]["hops"]["encode.text"]["p50"] == pytest.approx(
        st["queued"]["p50"] + st["service"]["p50"] - 4.0, abs=1e-3)


def test_a_sweep_validates_and_a_broken_run_does_not() -> None:
    runs = [synthetic_run(rate=r) for r in (5, 10)]
    assert validate({"mode": "pipeline", "workload": "text", "runs": runs}) == runs
    broken = synthetic_run()
    del broken["requests"]["lost"]
    broken["latency_ms"]["text"]["e2e"]["p50"] = "fast"
    with pytest.raises(BenchSchemaError) as info:
        validate(broken)
    assert any("lost" in p for p in info.value.problems)
    assert any("p50" in p for p in info.value.problems)
    assert schema_problems(True, {"type": "number"}) and not schema_problems(3, {"type": "number"})
    assert schema_problems({"mode": "x"}, RUN_SCHEMA)


def test_rag_agreement_compares_only_what_both_runs_answered() -> None:
    from mmstream.bench.retrieval_run import agreement

    assert agreement(["a", "b", None, "d", "e"], ["a", "x", "c", None, "e"]) == (2, 3)
    assert agreement([], []) == (0, 0)


def test_recall_against_exact_and_its_summary_split_by_reuse() -> None:
    from mmstream.bench.retrieval_recall import recall, summarize

    assert recall(["a", "b", "x"], ["a", "b", "c", "d"]) == 0.5 and recall(["a"], []) == 1.0
    got = summarize([(1.0, 1.0, False), (1.0, 0.8, True), (0.9, 0.9, True)])
    assert (got["queries"], got["plain"], got["answered"]) == (3, 0.9667, 0.9)
    assert got["answered_minus_plain_points"] == -6.67
    assert got["reused"] == {"queries": 2, "plain": 0.95, "answered": 0.85}
    assert got["searched"] == {"queries": 1, "plain": 1.0, "answered": 1.0}
    assert summarize([])["answered_minus_plain_points"] is None


def test_the_reuse_sweep_replays_queries_through_the_cache_against_a_real_index() -> None:
    import numpy as np

    from mmstream.bench.retrieval_recall import sweep
    from workers.retrieval.index import CollectionIndex

    rng = np.random.default_rng(3)
    index = CollectionIndex(16)
    docs = rng.normal(size=(300, 16)).astype(np.float32)
    index.upsert_many([(f"d{i}", v, None) for i, v in enumerate(docs)])
    base = rng.normal(size=(20, 16)).astype(np.float32)
    queries = [*base, *(b + 0.01 * rng.normal(size=16).astype(np.float32) for b in base)]  # each asked twice
    got = {(r["pool"], r["threshold"]): r for r in sweep(index, queries, 5, [(100, 0.99), (100, 0.999999)], 64)}
    near = got[(100, 0.99)]
    assert near["avoided"] == 0.5 and near["recall_plain"] > 0.9 and near["points"] > -5  # the 20 retypes answered
    assert got[(100, 0.999999)]["avoided"] == 0.0 and got[(100, 0.999999)]["points"] == 0.0


def test_the_image_retrieval_workload_is_seeded_and_its_queries_are_not_documents():
    from mmstream.bench.retrieval_images import PHOTOS, documents, queries

    docs = documents(len(PHOTOS) * 2, seed=5)
    assert docs == documents(len(PHOTOS) * 2, seed=5)
    assert len({d for d, _, _ in docs}) == len(docs) and {name for _, name, _ in docs} == set(PHOTOS)
    asked = queries(12, seed=6, repeat=0.5)
    assert asked == queries(12, seed=6, repeat=0.5) and all(data[:2] == b"\xff\xd8" for _, data in asked)
    assert not {data for _, data in asked} & {data for _, _, data in docs}


def test_the_slowest_requests_are_listed_with_their_stages_slowest_first() -> None:
    stage = {"stage": "encode.text", "queued_ms": 1.0, "service_ms": 2.0}
    records = [Record("text", ("text",), 1000.0 + i, 1000.0 + i + ms, "ok", [stage])
               for i, ms in enumerate([10.0] * 995 + [50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0])]
    records.append(Record("text", ("text",), 0.0, 500.0, "deadline_exceeded"))  # not answered: not a latency
    run = build_run("pipeline", BenchConfig(), 10.0, records, 5.0, {}, {})
    worst = run["slowest"]
    assert [r["e2e_ms"] for r in worst] == [99.0, 95.0, 90.0, 80.0, 70.0, 60.0, 50.0] + [10.0] * 4  # 1% of 1,002, up
    assert worst[0]["sent_s"] == 1.001 and worst[0]["stages"] == [stage]
    assert build_run("pipeline", BenchConfig(), 10.0, [], 5.0, {}, {})["slowest"] == []


def test_the_load_generators_own_lag_is_reported_apart_from_the_stages() -> None:
    """A request submitted 30 ms after its scheduled time counts those 30 ms in e2e (no
    coordinated omission), and the run says they were the generator's, not a stage's."""
    on_time = [Record("text", ("text",), 1000.0 + i, 1010.0 + i, "ok", submitted_at_ms=1000.0 + i) for i in range(99)]
    late = Record("text", ("text",), 5000.0, 5045.0, "ok", submitted_at_ms=5030.0)
    run = build_run("pipeline", BenchConfig(), 10.0, [*on_time, late], 5.0, {}, {})
    assert run["slowest"][0]["e2e_ms"] == 45.0 and run["slowest"][0]["submit_lag_ms"] == 30.0
    assert run["client"]["submit_lag_ms"]["max"] == 30.0 and run["client"]["submit_lag_ms"]["p50"] == 0.0


def test_the_answers_way_back_is_measured_from_the_event_the_stage_built() -> None:
    """What no stage's span covers (the answering stage's produce, the broker, the client's
    fetch) is the client's receipt less the terminal event's own time; a request with no
    answer has none."""
    req = Request(id="r1", tenant="t", task="embed", parts=[Part(modality="text", text="hi")])
    sub = Submission("r1", 1000.0, submitted_at_ms=1000.0)
    sub.terminal = Event("r1", EventKind.RESULT, 1, 1020.0, payload={}, timings={"stages": []})
    sub.terminal_at_ms = 1032.5
    answered = _pipeline_record(req, sub)
    lost = _pipeline_record(req, Submission("r2", 1000.0, submitted_at_ms=1000.0))
    assert return_ms(answered) == 12.5 and return_ms(lost) is None
    run = build_run("pipeline", BenchConfig(), 10.0, [answered, lost], 5.0, {}, {})
    assert run["client"]["return_ms"]["max"] == 12.5 and run["client"]["return_ms"]["count"] == 1
    assert run["slowest"][0]["return_ms"] == 12.5
