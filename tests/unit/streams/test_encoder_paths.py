"""The encoder stage's two ways to a job's answer, without Kafka (a recorder stands in for
``StageIO``; the runner is ``EncoderFront`` over a counting engine and a dict for the cache):

- idle (nothing queued, running or being prepared, and company worth nothing), the engine
  thread prepares and runs a polled batch in one call while the prep thread asks the cache;
- otherwise the prep thread prepares and looks up, and the batch loop runs what missed.

Either way each job is answered once, through its record or, for a job a co-located router
handed over, through the router's ``send``; and nothing is held afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from aiokafka.structs import ConsumerRecord

from schemas.codec import pack, unpack
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from streams.app import create_app
from streams.health import WorkerHealth
from streams.metrics import Metrics
from streams.stages.encoder import EncoderStage
from workers.cache import CacheFront, pack_output
from workers.encoders import EncoderFront, Runner
from workers.outputs import Prepared

PREFIX = "unit"


class Recorder:
    def __init__(self) -> None:
        self.answers: list[tuple[dict, list[int]]] = []
        self.epoch = 0

    def hold(self, inputs):
        pass

    def deliver(self, outs, inputs=(), epoch=None):
        for o in outs:
            self.answers.append((unpack(o.value), [r.offset for r in inputs]))

    def pause(self, topic):
        pass

    def resume(self, topic):
        pass

    def backlog(self, topic):
        return 0

    def assignment(self):
        return set()


class DictCache:
    def __init__(self, store=None):
        self.store = dict(store or {})
        self.lookups: list[bool] = []

    def lookup_or_claim(self, keys, hold_ms):
        return [self.store.get(k, True) for k in keys]

    def get_many(self, keys):
        return [self.store.get(k) for k in keys]

    def set_many(self, items):
        self.store.update(items)
        return True


@pytest.fixture
def stage(tmp_path):
    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    ran: list[list[str]] = []
    gate = threading.Event()
    gate.set()

    def prepare(job):
        return Prepared(job, float(len(job.text)), job.text, content=job.text.encode())

    def run(items):
        gate.wait(10)
        ran.append([i.data for i in items])
        return [np.full(4, len(i.data), dtype=np.float32) for i in items]

    cache = DictCache({"k:cached": pack_output(np.ones(4, dtype=np.float32), {}, "float16")})
    front = EncoderFront(Runner(prepare, run, rows_alone=True, variable_length=True), None,
                         CacheFront(cache, Metrics(health=WorkerHealth()), "text"),
                         key_of=lambda job, content: f"k:{content.decode()}")
    s = EncoderStage(create_app(settings, "encode.text", health=WorkerHealth()), settings,
                     Metrics(health=WorkerHealth()), "text", front)
    s.io = Recorder()
    s.ran, s.gate, s.cache = ran, gate, cache
    yield s
    gate.set()


def _job(text: str, i: int) -> EncodeJob:
    return EncodeJob(id=f"r{i}", part=0, n_parts=1, modality="text", lane="rt", tenant="t", deadline_at_ms=1e18,
                     sent_at_ms=0, text=text)


def _record(job: EncodeJob, offset: int) -> ConsumerRecord:
    value = pack(job.to_wire())
    return ConsumerRecord(f"{PREFIX}.encode.text.rt", 0, offset, 0, 0, None, value, None, 0, len(value), [])


async def _until(cond, what: str) -> None:
    for _ in range(300):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_an_idle_encoder_runs_a_polled_batch_directly_and_a_cache_hit_found_meanwhile_wins(stage) -> None:
    assert stage._engine_idle()  # noqa: SLF001
    await stage.handle([_record(_job("fresh", 1), 10), _record(_job("cached", 2), 11)])
    await _until(lambda: len(stage.io.answers) == 2, "both answered")
    assert stage.ran == [["fresh", "cached"]]  # one engine call, the hit computed too (the engine was idle)
    by_id = {a["id"]: (a, offsets) for a, offsets in stage.io.answers}
    assert by_id["r1"][0]["cache"] == "miss" and by_id["r1"][1] == [10]
    assert by_id["r2"][0]["cache"] == "hit" and by_id["r2"][1] == [11]  # the cached answer, not the recomputed one
    assert stage.held == 0 and stage._engine_idle()  # noqa: SLF001
    await _until(lambda: "k:fresh" in stage.cache.store, "the miss stored")


async def test_a_busy_engine_queues_jobs_for_the_batch_loop_and_each_is_answered_once(stage) -> None:
    loop_task = asyncio.create_task(stage._batches_forever())  # noqa: SLF001 - the batch loop, without Kafka
    stage.gate.clear()  # the first direct run blocks in the engine
    await stage.handle([_record(_job("first", 1), 1)])
    await _until(lambda: stage.direct_ms > 0, "a direct run")
    await stage.handle([_record(_job("second", 2), 2), _record(_job("third", 3), 3)])
    assert not stage._engine_idle()  # noqa: SLF001
    stage.gate.set()
    await _until(lambda: len(stage.io.answers) == 3, "all three answered")
    assert stage.ran[0] == ["first"] and sorted(x for batch in stage.ran[1:] for x in batch) == ["second", "third"]
    assert sorted(o for _, offsets in stage.io.answers for o in offsets) == [1, 2, 3]
    assert stage.held == 0
    loop_task.cancel()


async def test_jobs_handed_over_in_process_are_answered_through_the_routers_send(stage) -> None:
    sent: list[dict] = []
    expired = dataclasses.replace(_job("expired", 8), deadline_at_ms=1.0)
    taken = stage.take_local([(_job("local", 7), 1.0, lambda out: sent.append(unpack(out.value))),
                              (expired, 1.0, lambda out: sent.append(unpack(out.value)))], max_queued_ms=25.0, max_part_ms=25.0)
    assert taken == [True, True]
    await _until(lambda: len(sent) == 2, "both answered")
    by_id = {a["id"]: a for a in sent}
    assert by_id["r7"]["embedding"] is not None and by_id["r8"]["error"]["code"] == "deadline_exceeded"
    assert not stage.io.answers and stage.held == 0  # no record of their own; nothing left held
    assert stage.take_local([(_job("busy", 9), 1.0, sent.append)], max_queued_ms=-1.0, max_part_ms=25.0) == [False]


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "arrival"])
async def test_a_tenants_backlog_does_not_hold_another_tenants_job_behind_it(stage, fair) -> None:
    stage.fair = fair
    stage.gate.clear()
    await stage.handle([_record(_job("first", 0), 0)])
    await _until(lambda: stage.direct_ms > 0, "a direct run")
    flood = [_record(dataclasses.replace(_job(f"a{i:02d}" * 20, i), tenant="a"), i) for i in range(1, 11)]
    await stage.handle(flood)
    await stage.handle([_record(dataclasses.replace(_job("b", 11), tenant="b"), 11)])
    await _until(lambda: len(stage.queues["rt"]) == 11, "all queued")
    stage.gate.set()
    loop_task = asyncio.create_task(stage._batches_forever())  # noqa: SLF001 - started once all are queued
    await _until(lambda: len(stage.io.answers) == 12, "all answered")
    order = [x for batch in stage.ran[1:] for x in batch]
    assert order.index("b") == (1 if fair else 10)  # behind one of A's, or behind all ten
    loop_task.cancel()


async def test_bulk_holds_at_most_half_the_stage_and_a_poll_never_takes_more_than_the_room(stage) -> None:
    stage.max_queue = 8
    stage.gate.clear()  # nothing finishes meanwhile
    bulk = []
    for i in range(4):
        job = dataclasses.replace(_job(f"bulk{i}", i), lane="bulk")
        value = pack(job.to_wire())
        bulk.append(ConsumerRecord(f"{PREFIX}.encode.text.bulk", 0, i, 0, 0, None, value, None, 0, len(value), []))
    assert stage.should_take_bulk() and stage.poll_budget() == 8
    await stage.handle(bulk[:3])
    assert stage.should_take_bulk() and stage.poll_budget() == 5
    await stage.handle(bulk[3:])
    assert not stage.should_take_bulk()  # half of the stage is bulk's: the rest stays rt's
    assert stage.poll_budget() == 4 and not stage.paused
    loop_task = asyncio.create_task(stage._batches_forever())  # noqa: SLF001
    stage.gate.set()
    await _until(lambda: stage.held == 0, "all answered")
    assert stage.held_bulk == 0 and stage.should_take_bulk()
    loop_task.cancel()


async def test_jobs_being_prepared_count_as_queued_work_for_placement_and_the_report(stage) -> None:
    stage.gate.clear()
    await stage.handle([_record(_job("first", 0), 0)])  # the engine is busy from here
    await _until(lambda: stage.direct_ms > 0, "a direct run")
    prep_gate = threading.Event()
    prepare_many = stage.runner.prepare_many
    stage.runner.prepare_many = lambda jobs: (prep_gate.wait(10), prepare_many(jobs))[1]
    before = stage.queued_ms("rt")
    await stage.handle([_record(_job("x" * 3000, i), i) for i in range(1, 4)])  # long texts, still tokenizing
    assert stage.queued_ms("rt") - before == pytest.approx(3 * stage.model.per_item_ms(256))
    assert stage.report()["queued_rt_ms"] >= stage.queued_ms("rt") - 1e-6
    prep_gate.set()
    loop_task = asyncio.create_task(stage._batches_forever())  # noqa: SLF001
    stage.gate.set()
    await _until(lambda: stage.held == 0, "all answered")
    assert stage.preparing_ms == {"rt": 0.0, "bulk": 0.0}
    loop_task.cancel()
