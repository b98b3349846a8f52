"""The encoder core alone: no Kafka, no Faust, no metrics. The runner is ``EncoderFront`` over
a counting engine (gated, so a test decides when a batch finishes) and a dict for the reuse
cache; answers are collected from ``on_answer``.

What it holds: every submitted job is answered exactly once, by the direct path (idle
engine) or through the queues and ``step``; a cache hit never reaches the engine; work past
its deadline never does either; a tenant's backlog does not hold another tenant's job behind
it in fair order; jobs being prepared count as queued work."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from schemas.jobs import EncodeJob
from schemas.settings_serving import EncoderSettings
from schemas.trace import now_ms
from streams.cores import encoder as encoder_core
from streams.cores.encoder import EncodeAnswer, EncoderCore, _Turn
from tests.unit.streams.encoder_fakes import DictCache, Quiet
from workers.cache import CacheFront, pack_output
from workers.encoders import EncoderFront, Runner
from workers.outputs import Encoded, Prepared


class Harness:
    """A core over a gated engine: ``ran`` lists each engine call's texts; ``answers`` each answer."""

    def __init__(self, order: str = "fair", max_wait_ms: float = 4.0, thread_nice: int = 0, max_wait_rt_ms: float = 0.0,
                 **limits) -> None:
        self.ran: list[list[str]] = []
        self.prepared_on: dict[str, tuple[str, int]] = {}  # job id -> (thread name, its nice value)
        self.slow_prep = threading.Event()  # a text starting "slow" is prepared once this is set
        self.slow_prep.set()
        self.gate = threading.Event()
        self.gate.set()
        self.answers: list[EncodeAnswer] = []
        self.cache = DictCache({"k:cached": pack_output(np.ones(4, dtype=np.float32), {}, "float16")})

        def prepare(job):
            tid = threading.get_native_id()
            self.prepared_on[job.id] = (threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid))
            if job.text.startswith("slow"):
                self.slow_prep.wait(10)
            if job.text == "refuse":
                raise ValueError("refused by preprocessing")
            return Prepared(job, float(len(job.text)), job.text, content=job.text.encode())

        def run(items):
            self.gate.wait(10)
            self.ran.append([i.data for i in items])
            return [np.full(4, len(i.data), dtype=np.float32) for i in items]

        self.heavy_path: set[str] = set()  # jobs prepared by the runner's prepare_heavy

        def prepare_heavy(job):
            self.heavy_path.add(job.id)
            return prepare(job)

        front = EncoderFront(Runner(prepare, run, rows_alone=True, variable_length=True, prepare_heavy=prepare_heavy), None,
                             CacheFront(self.cache, Quiet(), "text"), key_of=lambda job, content: f"k:{content.decode()}")
        self.core = EncoderCore(front, EncoderSettings(order=order, max_wait_ms=max_wait_ms, max_wait_rt_ms=max_wait_rt_ms, **limits), "text", self.answers.append,
                                Quiet(), thread_nice=thread_nice)

    def by_id(self) -> dict[str, EncodeAnswer]:
        return {a.job.id: a for a in self.answers}


def _job(text: str, i: int, **kw) -> EncodeJob:
    fields = dict(id=f"r{i}", part=0, n_parts=1, modality="text", lane="rt", tenant="t", deadline_at_ms=1e18,
                  sent_at_ms=0, text=text)
    fields.update(kw)
    return EncodeJob(**fields)


def _submit(core: EncoderCore, *jobs: EncodeJob) -> None:
    core.submit([(j, "bulk" if j.lane == "bulk" else "rt", f"origin-{j.id}") for j in jobs])


async def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_an_idle_core_runs_a_submitted_batch_directly_and_a_cache_hit_found_meanwhile_wins() -> None:
    h = Harness()
    assert h.core.engine_idle()
    _submit(h.core, _job("fresh", 1), _job("cached", 2))
    await _until(lambda: len(h.answers) == 2, "both answered")
    assert h.ran == [["fresh", "cached"]]  # one engine call, the hit computed too (the engine was idle)
    got = h.by_id()
    assert got["r1"].result.cache == "miss" and got["r1"].origin == "origin-r1" and got["r1"].span is not None
    assert got["r2"].result.cache == "hit"  # the cached answer, not the recomputed one
    assert h.core.held == 0 and h.core.engine_idle()
    await _until(lambda: "k:fresh" in h.cache.store, "the miss stored")


async def test_outputs_go_to_the_reuse_cache_only_after_their_answers_left(monkeypatch) -> None:
    """The store runs on the prep thread; started with the answers it contends with the loop
    sending them, so it waits ``STORE_AFTER_S`` (stretched here to be seen)."""
    monkeypatch.setattr(encoder_core, "STORE_AFTER_S", 0.3)
    h = Harness()
    _submit(h.core, _job("fresh", 1))
    await _until(lambda: len(h.answers) == 1, "answered")
    await asyncio.sleep(0.1)
    assert "k:fresh" not in h.cache.store
    await _until(lambda: "k:fresh" in h.cache.store, "the miss stored after the delay")


async def test_a_busy_engine_queues_jobs_for_step_and_each_is_answered_once() -> None:
    h = Harness()
    h.gate.clear()  # the first direct run blocks in the engine
    _submit(h.core, _job("first", 1))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    _submit(h.core, _job("second", 2), _job("third", 3), _job("cached", 4), _job("refuse", 5))
    assert not h.core.engine_idle()
    await _until(lambda: len(h.answers) == 2, "the hit and the refusal answered without the engine")
    assert {a.job.id for a in h.answers} == {"r4", "r5"} and isinstance(h.by_id()["r5"].result, Exception)
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 5, "all five answered")
    assert h.ran[0] == ["first"] and sorted(x for batch in h.ran[1:] for x in batch) == ["second", "third"]
    assert sorted(a.job.id for a in h.answers) == ["r1", "r2", "r3", "r4", "r5"]
    assert h.core.held == 0 and h.core.queued_ms("bulk") == 0.0
    runner.cancel()


async def test_work_past_its_deadline_is_answered_and_never_reaches_the_engine() -> None:
    h = Harness()
    _submit(h.core, _job("late", 1, deadline_at_ms=1.0))
    assert h.by_id()["r1"].result.code == "deadline_exceeded" and h.by_id()["r1"].span is None
    h.gate.clear()
    _submit(h.core, _job("first", 2))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    soon = _job("expires-in-queue", 3, deadline_at_ms=now_ms() + 150)
    _submit(h.core, soon)
    await _until(lambda: len(h.core.queues["rt"]) == 1, "queued")
    await asyncio.sleep(0.2)  # its deadline passes while it waits behind the running batch
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 3, "all answered")
    assert h.by_id()["r3"].result.code == "deadline_exceeded"
    assert h.ran == [["first"]] and h.core.held == 0
    runner.cancel()


def _backdate(core: EncoderCore, *ids: str, by_s: float = 5.0, standing: bool = True) -> None:
    """Make the queued jobs ``ids`` look as if they joined the engine's queue ``by_s`` earlier
    (no test sleeps past a bound: a slow box would make the in-time side late too), and, when
    ``standing``, the rt queue as if it had held work since then."""
    for queue in core.queues.values():
        for i, p in enumerate(queue):
            if p.item.prepared.job.id in ids:
                queue[i] = dataclasses.replace(p, enqueued_at=p.enqueued_at - by_s)
    if standing:
        core.rt_busy_since -= by_s


async def _queued_behind_a_running_batch(h: Harness, *jobs: EncodeJob) -> None:
    h.gate.clear()  # the first direct run blocks in the engine; the others queue behind it
    _submit(h.core, _job("first", 0))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    _submit(h.core, *jobs)
    await _until(lambda: sum(map(len, h.core.queues.values())) == len(jobs), "all queued")


async def _release_and_expect_every_job_run(h: Harness, jobs: int) -> None:
    """Open the engine and step the core until ``jobs`` are answered, each by the engine."""
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == jobs, "all answered")
    assert all(isinstance(a.result, Encoded) for a in h.answers) and h.core.late == 0
    runner.cancel()


async def test_an_rt_job_that_waited_past_the_bound_is_refused_overloaded_and_never_reaches_the_engine() -> None:
    """``max_wait_rt_ms``: admission predicted its wait short; it is refused with a retry-after
    rather than run late, and its wait teaches the calibration. A bulk job that waited as long
    still runs, and so does an rt job in time."""
    h = Harness(max_wait_rt_ms=2000.0)
    await _queued_behind_a_running_batch(h, _job("waits-too-long", 1, predicted_wait_ms=10.0),
                                         _job("bulk-waits", 2, lane="bulk"), _job("in-time", 3))
    _backdate(h.core, "r1", "r2")
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 4, "all answered")
    late = h.by_id()["r1"].result
    assert late.code == "overloaded" and late.retry_after_ms >= encoder_core.MIN_RETRY_AFTER_MS
    assert h.by_id()["r1"].span is None and h.core.late == 1 and h.core.waits.observed == 1
    assert sorted(x for batch in h.ran for x in batch) == ["bulk-waits", "first", "in-time"]
    assert h.core.held == 0
    runner.cancel()


async def test_the_wait_bound_refuses_nothing_in_a_burst_the_engine_drains() -> None:
    """A queue that emptied within ``STANDING_QUEUE_S`` holds a burst, not a stage past its
    capacity: admission admitted it whole, and it runs whole, however long its last job waited."""
    h = Harness(max_wait_rt_ms=100.0)
    await _queued_behind_a_running_batch(h, _job("burst-1", 1), _job("burst-2", 2))
    _backdate(h.core, "r1", "r2", by_s=0.5, standing=False)  # waited 500 ms, the queue busy for less than 1 s
    await _release_and_expect_every_job_run(h, 3)


async def test_the_queue_stands_from_when_work_joined_it_empty_until_it_drains() -> None:
    """``rt_busy_since``: set by the job that finds the rt queue empty, kept by those that join
    it busy, set again after the queue drained; a queue that refusals emptied still stands for
    work that comes within the interval."""
    h = Harness(max_wait_rt_ms=100.0)
    await _queued_behind_a_running_batch(h, _job("a", 1), _job("b", 2))
    first = h.core.queues["rt"][0].enqueued_at
    assert h.core.rt_busy_since == first
    _submit(h.core, _job("c", 3))
    await _until(lambda: len(h.core.queues["rt"]) == 3, "queued behind the others")
    assert h.core.rt_busy_since == first  # joined a busy queue
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 4, "drained")
    runner.cancel()
    h.gate.clear()
    _submit(h.core, _job("d", 4))
    await _until(lambda: h.core.direct_ms > 0 and not h.core.engine_idle(), "a direct run")
    _submit(h.core, _job("e", 5))
    await _until(lambda: len(h.core.queues["rt"]) == 1, "queued again")
    assert h.core.rt_busy_since == h.core.queues["rt"][0].enqueued_at > first  # a new busy period
    _backdate(h.core, "r5", by_s=5.0)  # it stood 5 s; its one job waited past the bound
    h.core._refuse_late(time.monotonic())
    assert h.by_id()["r5"].result.code == "overloaded" and not h.core.queues["rt"]
    stood_since = h.core.rt_busy_since
    _submit(h.core, _job("f", 6))
    await _until(lambda: len(h.core.queues["rt"]) == 1, "queued after the refusal")
    assert h.core.rt_busy_since == stood_since  # refusals emptied it: it did not drain
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 7, "all answered")
    runner.cancel()


async def test_with_no_wait_bound_a_late_rt_job_still_runs() -> None:
    h = Harness(max_wait_rt_ms=0.0)
    await _queued_behind_a_running_batch(h, _job("waits", 1))
    _backdate(h.core, "r1")
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 2, "both answered")
    assert h.ran == [["first"], ["waits"]] and h.core.late == 0
    runner.cancel()


async def test_the_wait_bound_spares_the_parts_of_a_several_part_request_and_a_videos_chunks() -> None:
    """Such a part waits for its siblings too, and refused alone would leave its request partial."""
    h = Harness(max_wait_rt_ms=2000.0)
    await _queued_behind_a_running_batch(h, _job("sibling", 1, n_parts=2), _job("chunk", 2, chunk=0),
                                         _job("alone", 3))
    _backdate(h.core, "r1", "r2", "r3")
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 4, "all answered")
    got = h.by_id()
    assert isinstance(got["r1"].result, Encoded) and isinstance(got["r2"].result, Encoded)
    assert got["r3"].result.code == "overloaded"
    runner.cancel()


async def test_a_job_past_its_deadline_is_answered_so_even_when_it_is_late_too() -> None:
    h = Harness(max_wait_rt_ms=2000.0)
    await _queued_behind_a_running_batch(h, _job("expired", 1, deadline_at_ms=now_ms() + 100))
    _backdate(h.core, "r1")
    await asyncio.sleep(0.15)  # its deadline passes
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 2, "both answered")
    assert h.by_id()["r1"].result.code == "deadline_exceeded" and h.core.late == 0  # once, never run
    assert h.ran == [["first"]]
    runner.cancel()


@pytest.mark.parametrize("order", ["fair", "arrival"])
async def test_a_tenants_backlog_does_not_hold_another_tenants_job_behind_it(order) -> None:
    h = Harness(order=order)
    h.gate.clear()
    _submit(h.core, _job("first", 0))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    _submit(h.core, *[_job(f"a{i:02d}" * 20, i, tenant="a") for i in range(1, 11)])
    _submit(h.core, _job("b", 11, tenant="b"))
    await _until(lambda: len(h.core.queues["rt"]) == 11, "all queued")
    h.gate.set()
    runner = asyncio.create_task(h.core.run(lambda: False))  # started once all are queued
    await _until(lambda: len(h.answers) == 12, "all answered")
    order_run = [x for batch in h.ran[1:] for x in batch]
    assert order_run.index("b") == (1 if order == "fair" else 10)  # behind one of A's, or behind all ten
    runner.cancel()


async def test_jobs_being_prepared_count_as_queued_work() -> None:
    h = Harness()
    h.gate.clear()
    _submit(h.core, _job("first", 0))  # the engine is busy from here
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    prep_gate = threading.Event()
    prepare_many = h.core.runner.prepare_many
    h.core.runner.prepare_many = lambda jobs: (prep_gate.wait(10), prepare_many(jobs))[1]
    before = h.core.queued_ms("rt") - h.core.in_service_ms()  # what runs counts down as it runs
    _submit(h.core, *[_job("x" * 3000, i) for i in range(1, 4)])  # long texts, still tokenizing
    now = h.core.queued_ms("rt") - h.core.in_service_ms()
    assert now - before == pytest.approx(3 * h.core.model.per_item_ms(256), abs=0.5)
    assert h.core.queued_ms("bulk") >= h.core.queued_ms("rt")
    prep_gate.set()
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: h.core.held == 0, "all answered")
    assert h.core.preparing_ms == {"rt": 0.0, "bulk": 0.0}
    runner.cancel()


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["rt", "bulk"]), st.sampled_from(["short", "a longer text", "cached",
                                                                              "refuse", "late"]),
                          st.sampled_from(["t1", "t2"]), st.sampled_from([None, 5.0, 400.0])), min_size=1, max_size=24),
       st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_every_submitted_job_is_answered_exactly_once(jobs, chunks) -> None:
    async def scenario() -> None:
        h = Harness(heavy_prep_ms=50.0)  # jobs priced 400 ms go through the heavy thread's turns
        runner = asyncio.create_task(h.core.run(lambda: False))
        built = [_job("x" if text == "late" else text, i, lane=lane, tenant=tenant, prep_ms=prep_ms,
                      deadline_at_ms=1.0 if text == "late" else 1e18)
                 for i, (lane, text, tenant, prep_ms) in enumerate(jobs)]
        at = 0
        for n in (chunks * len(built))[: len(built)]:
            if at >= len(built):
                break
            _submit(h.core, *built[at: at + n])
            at += n
            await asyncio.sleep(0)
        await _until(lambda: h.core.held == 0, "nothing held")
        runner.cancel()
        assert sorted(a.job.id for a in h.answers) == sorted(j.id for j in built)
        assert h.core.held_bulk == 0 and not h.core.queues["rt"] and not h.core.queues["bulk"]
        assert not h.core.heavy_busy and not h.core.heavy_turns.items
        for a in h.answers:
            assert isinstance(a.result, (Encoded, Exception))

    asyncio.run(scenario())



async def test_a_bug_before_preparing_answers_each_job_with_internal_and_holds_nothing() -> None:
    h = Harness()

    def broken(job):
        raise RuntimeError("a spec's units() failed")

    h.core._length_before_prep = broken  # noqa: SLF001 - stands in for a plugin's buggy spec
    _submit(h.core, _job("a", 1), _job("b", 2, lane="bulk"))
    assert sorted(a.job.id for a in h.answers) == ["r1", "r2"]
    assert all(a.result.code == "internal" for a in h.answers)
    assert h.core.held == 0 and h.core.held_bulk == 0 and h.core.engine_idle()


async def test_a_job_priced_heavy_is_prepared_on_a_thread_of_lower_priority_and_still_looked_up() -> None:
    h = Harness(heavy_prep_ms=50.0, heavy_prep_nice=5)
    h.gate.clear()  # the engine stays busy with the first batch: the rest go through the prep threads
    base = os.getpriority(os.PRIO_PROCESS, 0)
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:
        _submit(h.core, _job("first", 0))
        await _until(lambda: h.core.running_ms > 0 or h.core.direct_ms > 0, "the first batch running")
        _submit(h.core, _job("light", 1, prep_ms=10.0), _job("heavy", 2, prep_ms=400.0),
                _job("cached", 3, prep_ms=400.0))
        await _until(lambda: {"r2", "r3"} <= set(h.prepared_on), "the heavy jobs prepared")
        h.gate.set()
        await _until(lambda: len(h.answers) == 4, "every job answered")
    finally:
        h.gate.set()
        runner.cancel()
    assert sorted(a.job.id for a in h.answers) == ["r0", "r1", "r2", "r3"]  # each exactly once
    heavy, light = h.prepared_on["r2"], h.prepared_on["r1"]
    assert heavy[0].startswith("prep-heavy-") and not light[0].startswith("prep-heavy-")
    assert h.heavy_path == {"r2", "r3"}  # the runner's own heavy preparation (images: a process of its own)
    if sys.platform.startswith("linux"):
        assert heavy[1] == min(19, base + 5) and light[1] == base
    assert isinstance(h.by_id()["r3"].result, Encoded)  # the cache lookup still answers a heavy job
    assert not any("cached" in batch for batch in h.ran) and any("heavy" in batch for batch in h.ran)


async def test_a_heavy_jobs_preparation_holds_no_later_light_job_behind_it() -> None:
    h = Harness(heavy_prep_ms=50.0)
    h.slow_prep.clear()  # the heavy job's decode takes until the light one is answered
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:
        _submit(h.core, _job("slow heavy", 1, prep_ms=6000.0))
        await _until(lambda: "r1" in h.prepared_on, "the heavy job being prepared")
        assert h.core.engine_idle()  # a heavy decode leaves the engine free for the direct path
        _submit(h.core, _job("light", 2, prep_ms=5.0))
        await _until(lambda: "r2" in h.by_id(), "the light job answered while the heavy one is still prepared")
        assert "r1" not in h.by_id()
        h.slow_prep.set()
        await _until(lambda: "r1" in h.by_id(), "the heavy job answered")
    finally:
        h.slow_prep.set()
        runner.cancel()


async def test_the_wait_bound_counts_no_preparation() -> None:
    """A job's own decode (a cold one; a heavy one's, priced just over the heavy threshold) is no
    wait: decodes far longer than price plus bound, then a short queue, and both run."""
    h = Harness(max_wait_rt_ms=300.0, heavy_prep_ms=50.0)
    h.gate.clear()
    _submit(h.core, _job("first", 0))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")  # the light job is queued, not run directly
    h.slow_prep.clear()
    _submit(h.core, _job("slow heavy", 1, prep_ms=60.0), _job("slow light", 2, prep_ms=5.0))
    await _until(lambda: {"r1", "r2"} <= set(h.prepared_on), "both being prepared")
    await asyncio.sleep(0.5)  # past 60 + 300 ms
    h.slow_prep.set()
    await _until(lambda: len(h.core.queues["rt"]) == 2, "both queued once prepared")
    h.core.rt_busy_since -= 5.0  # a standing queue: the bound applies
    await _release_and_expect_every_job_run(h, 3)


async def test_a_heavy_job_cancelled_mid_decode_keeps_the_turn_until_its_decode_ends() -> None:
    h = Harness(heavy_prep_ms=50.0)
    h.slow_prep.clear()
    try:
        task = asyncio.create_task(h.core._prepare_heavy(_job("slow heavy", 1, prep_ms=6000.0)))
        await _until(lambda: "r1" in h.prepared_on, "the decode running")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert h.core.heavy_busy  # the thread is still decoding: no other job may take its turn
        h.slow_prep.set()
        await _until(lambda: not h.core.heavy_busy, "the turn given back when the decode ended")
    finally:
        h.slow_prep.set()


async def test_when_starting_the_heavy_group_fails_each_job_is_still_answered_once() -> None:
    h = Harness(heavy_prep_ms=50.0)
    length = h.core._length_before_prep  # noqa: SLF001

    def broken(job):
        if (job.prep_ms or 0.0) > 50.0:
            raise RuntimeError("a spec's units raised")
        return length(job)

    h.core._length_before_prep = broken  # noqa: SLF001
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:
        _submit(h.core, _job("light", 1, prep_ms=5.0), _job("heavy", 2, prep_ms=400.0))
        await _until(lambda: len(h.answers) >= 2 and h.core.held == 0, "both answered")
        await asyncio.sleep(0.05)
    finally:
        runner.cancel()
    assert sorted(a.job.id for a in h.answers) == ["r1", "r2"] and h.core.held == 0
    assert not isinstance(h.by_id()["r1"].result, Exception) and isinstance(h.by_id()["r2"].result, Exception)


async def test_heavy_jobs_take_the_heavy_thread_in_fair_order_between_tenants() -> None:
    h = Harness(heavy_prep_ms=50.0)
    h.slow_prep.clear()  # tenant a's first decode runs until b's job has arrived
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:
        _submit(h.core, *(_job(f"slow a{i}", i, tenant="a", prep_ms=400.0) for i in range(1, 4)))
        await _until(lambda: "r1" in h.prepared_on, "a's first heavy job being prepared")
        _submit(h.core, _job("slow b", 9, tenant="b", prep_ms=400.0))
        await asyncio.sleep(0.05)
        assert list(h.prepared_on) == ["r1"]  # one heavy job on the thread at a time
        h.slow_prep.set()
        await _until(lambda: len(h.answers) == 4, "every job answered")
    finally:
        h.slow_prep.set()
        runner.cancel()
    # b waits for a's decode under way, not for a's whole batch
    assert list(h.prepared_on) == ["r1", "r9", "r2", "r3"]
    assert h.core.held == 0 and not h.core.heavy_busy and not h.core.heavy_turns.items


async def test_a_heavy_job_whose_turn_comes_past_its_deadline_is_answered_without_its_decode() -> None:
    h = Harness(heavy_prep_ms=50.0)
    h.slow_prep.clear()
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:
        _submit(h.core, _job("slow a", 1, tenant="a", prep_ms=400.0))
        await _until(lambda: "r1" in h.prepared_on, "a's heavy job being prepared")
        _submit(h.core, _job("b", 2, tenant="b", prep_ms=400.0, deadline_at_ms=now_ms() + 30))
        await asyncio.sleep(0.1)
        h.slow_prep.set()
        await _until(lambda: len(h.answers) == 2, "both answered")
    finally:
        h.slow_prep.set()
        runner.cancel()
    late = h.by_id()["r2"].result
    assert isinstance(late, Exception) and "deadline" in str(late) and "r2" not in h.prepared_on
    assert isinstance(h.by_id()["r1"].result, Encoded) and h.core.held == 0


async def test_a_waiting_heavy_turn_cancelled_just_before_the_thread_frees_is_passed_over() -> None:
    h = Harness(heavy_prep_ms=50.0)
    loop = asyncio.get_running_loop()
    turn = _Turn(h.core.heavy_turns.tag("b", 400.0), loop.create_future())
    h.core.heavy_busy = True  # a job holds the heavy thread
    h.core.heavy_turns.push(turn)
    turn.go.cancel()  # its task is cancelled; its handler has not run yet
    h.core._end_heavy_turn()  # noqa: SLF001 - the holder's decode ends first
    assert not h.core.heavy_busy and not h.core.heavy_turns.items
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:  # the thread still serves the next heavy job
        _submit(h.core, _job("heavy", 1, prep_ms=400.0))
        await _until(lambda: "r1" in h.by_id(), "the next heavy job answered")
    finally:
        runner.cancel()


async def test_rt_jobs_teach_the_core_how_far_the_routers_predicted_waits_run() -> None:
    """Each rt job that carries the router's predicted wait is compared with the wait it had from
    the router's send to the engine's start (or to its deadline, when it expired in the queue):
    jobs that waited far longer than predicted raise the scale the stage reports; bulk jobs,
    jobs without a prediction and jobs already expired when taken in teach nothing."""
    h = Harness()
    assert h.core.wait_scale() == 1.0
    sent = now_ms() - 400.0  # each was sent 400 ms ago, predicted to wait 10 ms
    h.gate.clear()  # the first runs directly and holds the engine: the rest go through the queue
    _submit(h.core, _job("late-0", 0, sent_at_ms=sent, predicted_wait_ms=10.0))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    _submit(h.core, *(_job(f"late-{i}", i, sent_at_ms=sent, predicted_wait_ms=10.0) for i in range(1, 20)),
            _job("expires", 50, sent_at_ms=sent, predicted_wait_ms=10.0, deadline_at_ms=now_ms() + 150))
    await _until(lambda: len(h.core.queues["rt"]) == 20, "queued")
    await asyncio.sleep(0.2)  # the last one's deadline passes in the queue
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 21, "all answered")
    assert h.by_id()["r50"].result.code == "deadline_exceeded"
    learned = h.core.wait_scale()
    assert learned > 1.5 and h.core.waits.observed == 21, learned
    _submit(h.core, *(_job(f"bulk-{i}", 100 + i, lane="bulk", sent_at_ms=sent, predicted_wait_ms=10.0) for i in range(5)),
            *(_job(f"blind-{i}", 200 + i, sent_at_ms=sent) for i in range(5)),
            _job("expired", 300, sent_at_ms=sent, predicted_wait_ms=10.0, deadline_at_ms=1.0))
    await _until(lambda: len(h.answers) == 32, "the bulk, unpredicted and expired jobs answered")
    assert h.by_id()["r300"].result.code == "deadline_exceeded"
    assert h.core.waits.observed == 21 and h.core.wait_scale() == learned
    runner.cancel()


async def test_what_the_wait_scale_learned_is_forgotten_once_nothing_teaches_it() -> None:
    h = Harness()
    sent = now_ms() - 2000.0
    _submit(h.core, *(_job(f"late-{i}", i, sent_at_ms=sent, predicted_wait_ms=10.0) for i in range(10)))
    await _until(lambda: len(h.answers) == 10, "answered")
    assert h.core.wait_scale() > 1.2
    h.core.waits_at -= encoder_core.WAIT_FORGET_S + 1  # an idle stage, that long after
    assert h.core.wait_scale() == 1.0 and h.core.waits.observed == 0


async def test_a_jobs_own_preparation_priced_by_the_router_counts_as_predicted() -> None:
    h = Harness()
    sent = now_ms() - 60.0  # each waited about 60 ms: 10 predicted in the queue, its own 40 ms decode
    _submit(h.core, *(_job(f"photo-{i}", i, sent_at_ms=sent, predicted_wait_ms=10.0, prep_ms=40.0) for i in range(20)))
    await _until(lambda: len(h.answers) == 20, "answered")
    assert h.core.waits.observed == 20
    assert h.core.wait_scale() < 1.3  # about (60 + 50) / (10 + 40 + 50); without the decode, (60 + 50) / (10 + 50)


async def test_a_heavy_jobs_wait_for_its_decode_turn_teaches_nothing() -> None:
    h = Harness(heavy_prep_ms=50.0)
    sent = now_ms() - 5000.0  # far later than predicted: its tenant's decodes ran ahead of it
    runner = asyncio.create_task(h.core.run(lambda: False))
    _submit(h.core, _job("heavy", 1, sent_at_ms=sent, predicted_wait_ms=10.0, prep_ms=400.0))
    await _until(lambda: len(h.answers) == 1, "answered")
    runner.cancel()
    assert h.ran == [["heavy"]] and h.core.waits.observed == 0 and h.core.waits.factor == 1.0


async def test_a_store_that_raises_is_logged_and_costs_no_answer(caplog) -> None:
    h = Harness()

    def broken_store(writes):
        raise RuntimeError("store bug")

    h.core.runner.store = broken_store
    _submit(h.core, _job("fresh", 1))
    await _until(lambda: "storing outputs in the reuse cache failed" in caplog.text, "the failed store logged")
    assert [a.job.id for a in h.answers] == ["r1"] and h.answers[0].result.cache == "miss"


async def test_an_encoder_placed_below_the_router_runs_its_engine_and_preparation_threads_lower() -> None:
    h = Harness(thread_nice=7)  # router.colocate_nice
    base = os.getpriority(os.PRIO_PROCESS, 0)
    engine_nice: list[int] = []
    h.core.engine.submit(lambda: engine_nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))).result()
    runner = asyncio.create_task(h.core.run(lambda: False))
    try:
        _submit(h.core, _job("one", 1))
        await _until(lambda: len(h.answers) == 1, "the job answered")
    finally:
        runner.cancel()
    if sys.platform.startswith("linux"):
        assert engine_nice == [min(19, base + 7)] and h.prepared_on["r1"][1] == min(19, base + 7)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the loop's thread untouched


async def test_what_the_engine_runs_counts_as_queued_only_for_what_is_left_of_its_prediction() -> None:
    """A report made late in a batch says how much of it is left, not the whole batch: read after
    it finished, the whole of it would stand ahead of the next request as work no one holds."""
    h = Harness()
    h.gate.clear()
    _submit(h.core, _job("first", 1))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    h.core.direct_ms = 300.0  # as if predicted at 300 ms
    h.core.direct_since = time.monotonic() - 0.1
    assert 190.0 <= h.core.in_service_ms() <= 200.0 and 190.0 <= h.core.queued_ms("rt") <= 200.0
    h.core.direct_since = time.monotonic() - 1.0  # ran past its prediction
    assert h.core.in_service_ms() == 0.0 and not h.core.engine_idle()  # still running: the direct path waits
    h.gate.set()
    await _until(lambda: h.core.held == 0, "answered")


async def test_a_direct_run_whose_every_job_the_cache_answered_still_teaches_the_cost_model() -> None:
    h = Harness()
    seen: list[tuple[list[float], float]] = []
    observe = h.core.model.observe_batch
    h.core.model.observe_batch = lambda lengths, ms: (seen.append((list(lengths), ms)), observe(lengths, ms))[1]
    _submit(h.core, _job("cached", 1))  # the engine runs it (idle) while the lookup finds it
    await _until(lambda: len(h.answers) == 1, "answered")
    assert h.ran == [["cached"]] and h.answers[0].result.cache == "hit"
    assert [lengths for lengths, _ in seen] == [[6.0]]  # the run the engine made, at its length


async def test_a_pool_runs_a_batch_of_work_admitted_in_debt_lower_and_only_while_nothing_else_waits() -> None:
    """``EncodeJob.background``: the request was admitted over its tenant's compute bucket. The
    pool runs such a batch lower (``hold_background``: how many it runs now, 0 when none) only
    where the batch is nothing else and no other job waits; another job arriving meanwhile brings
    it back at once, since it waits behind that batch."""
    h = Harness()
    moves: list[int] = []
    h.core.hold_background = moves.append
    _submit(h.core, _job("debt 1", 1, background=True))  # idle: the direct path
    await _until(lambda: len(h.answers) == 1, "answered")
    assert moves == [1, 0]

    moves.clear()
    h.gate.clear()
    _submit(h.core, _job("debt 2", 2, background=True))
    await _until(lambda: moves == [1], "lowered for the direct run")
    _submit(h.core, _job("ordinary 3", 3))  # waits behind it: back at the level now, not after
    assert moves == [1, 0]
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 3, "both answered")
    assert moves == [1, 0]  # the ordinary job's batch ran at the level

    moves.clear()
    h.gate.clear()
    _submit(h.core, _job("ordinary 4", 4))  # the engine busy with it ...
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    _submit(h.core, _job("debt 5", 5, background=True), _job("debt 6", 6, background=True))  # ... these queue
    await _until(lambda: h.core.queued_ms("rt") > 0 and h.core.preparing == 0, "queued")
    h.gate.set()
    await _until(lambda: len(h.answers) == 6, "all answered")
    assert moves == [2, 0] or moves == [1, 0, 1, 0]  # a batch of debt alone runs lower, then back

    runner.cancel()


async def test_a_batch_of_work_in_debt_runs_at_the_level_while_another_tenants_job_waits_behind_it() -> None:
    h = Harness(max_batch_size=1)  # one job a batch: who waits behind whom is decided per job
    moves: list[tuple[int, set[str]]] = []  # (how many lowered, the jobs queued then)
    h.core.hold_background = lambda n: moves.append((n, {origin for _, _, origin, _ in h.core.queued()}))
    h.gate.clear()
    _submit(h.core, _job("ordinary 1", 1))
    await _until(lambda: h.core.direct_ms > 0, "a direct run")
    _submit(h.core, _job("debt 2", 2, background=True), _job("debt 3", 3, background=True),
            _job("ordinary 4", 4, tenant="u"))
    await _until(lambda: len(list(h.core.queued())) == 3, "queued")
    runner = asyncio.create_task(h.core.run(lambda: False))
    h.gate.set()
    await _until(lambda: len(h.answers) == 4, "all answered")
    runner.cancel()
    lowered = [queued for n, queued in moves if n > 0]
    assert lowered, "the last debt job, alone with nothing behind it, ran lower"
    assert all("origin-r4" not in queued for queued in lowered)  # never while u's job waited
    assert moves[-1][0] == 0  # back at the level at the end
