"""The encode stage as glue around its ``EncoderCore`` (the core's own paths are in
``test_encoder_core.py``), without Kafka: a recorder stands in for ``StageIO``; the runner is
``EncoderFront`` over a counting engine and a dict for the cache.

Each job is answered once, through its record (delivered with that record's offset) or, for
a job a co-located router handed over, through the router's ``send``; an undecodable record
is dead-lettered alone; intake is bounded (bulk holds at most half the stage, no poll takes
more than the room left); the load report counts what the core holds."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from aiokafka.structs import ConsumerRecord

from schemas.codec import pack, unpack
from schemas.jobs import EncodeJob
from schemas.trace import now_ms
from schemas.settings import Settings
from streams.app import create_app
from streams.observe.health import WorkerHealth
from streams.observe.metrics import Metrics
from streams.stages.encoder import EncoderStage
from tests.unit.streams.encoder_fakes import DictCache
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
            self.answers.append((o.topic, unpack(o.value) if o.topic != f"{PREFIX}.dlq" else {}, [r.offset for r in inputs]))

    def pause(self, topic):
        pass

    def resume(self, topic):
        pass

    def backlog(self, topic):
        return 0

    def assignment(self):
        return set()


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


async def test_each_record_is_answered_once_with_its_offset_and_a_bad_one_is_dead_lettered_alone(stage) -> None:
    loop_task = asyncio.create_task(stage.core.run(lambda: False))
    bad = ConsumerRecord(f"{PREFIX}.encode.text.rt", 0, 12, 0, 0, None, b"\xc1 not msgpack", None, 0, 14, [])
    await stage.handle([_record(_job("fresh", 1), 10), _record(_job("cached", 2), 11), bad])
    await _until(lambda: len(stage.io.answers) == 3, "all three answered")
    await asyncio.sleep(0.05)  # a second answer to any of them would land by now
    assert len(stage.io.answers) == 3
    by_offset = {offsets[0]: (topic, a) for topic, a, offsets in stage.io.answers}
    assert by_offset[12][0] == f"{PREFIX}.dlq"
    assert by_offset[10] == (f"{PREFIX}.encoded.rt", by_offset[10][1]) and by_offset[10][1]["cache"] == "miss"
    assert by_offset[11][1]["cache"] == "hit" and by_offset[11][1]["id"] == "r2"
    assert by_offset[10][1]["trace"][-1][0] == "encode.text"  # the stage's span, from the core's timings
    assert stage.core.held == 0
    loop_task.cancel()


async def test_jobs_handed_over_in_process_are_answered_through_the_routers_send(stage) -> None:
    sent: list[dict] = []
    expired = dataclasses.replace(_job("expired", 8), deadline_at_ms=1.0)
    taken = stage.local.take([(_job("local", 7), 1.0, lambda out: sent.append(unpack(out.value))),
                              (expired, 1.0, lambda out: sent.append(unpack(out.value)))], max_queued_ms=25.0, max_part_ms=25.0)
    assert taken == [True, True]
    assert stage.local.modality == "text"  # what the router's bound is looked up by (router.max_queued_of)
    await _until(lambda: len(sent) == 2, "both answered")
    by_id = {a["id"]: a for a in sent}
    assert by_id["r7"]["embedding"] is not None and by_id["r8"]["error"]["code"] == "deadline_exceeded"
    assert not stage.io.answers and stage.core.held == 0  # no record of their own; nothing left held
    assert stage.local.take([(_job("busy", 9), 1.0, sent.append)], max_queued_ms=-1.0, max_part_ms=25.0) == [False]


async def test_a_job_handed_over_in_process_teaches_the_wait_calibration_nothing(stage) -> None:
    # It skipped the hop and was taken only onto a short queue: its wait is not the pool's.
    sent: list[dict] = []
    late = dataclasses.replace(_job("local-late", 11), predicted_wait_ms=1.0, sent_at_ms=now_ms() - 2000.0)
    assert stage.local.take([(late, 1.0, lambda out: sent.append(unpack(out.value)))], max_queued_ms=25.0,
                            max_part_ms=25.0) == [True]
    await _until(lambda: len(sent) == 1, "answered")
    assert sent[0]["embedding"] is not None and stage.core.waits.observed == 0


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
    assert stage.poll_budget() == 4
    loop_task = asyncio.create_task(stage.core.run(lambda: False))
    stage.gate.set()
    await _until(lambda: stage.core.held == 0, "all answered")
    assert stage.core.held_bulk == 0 and stage.should_take_bulk()
    loop_task.cancel()


async def test_a_full_stage_has_no_poll_budget_until_a_job_is_answered(stage) -> None:
    """At 0 the runtime pauses the topics (``RecordStage.intake_gate``); a co-located router's
    hand-overs are refused too."""
    paused: set[str] = set()
    stage.io.pause, stage.io.resume = paused.add, paused.discard
    stage.max_queue = 4
    stage.gate.clear()
    await stage.handle([_record(_job(f"j{i}", i), i) for i in range(4)])
    assert stage.poll_budget() == 0
    stage.intake_gate(stage.poll_budget() == 0)  # what the runtime's poll loop does
    assert paused == {f"{PREFIX}.encode.text.rt", f"{PREFIX}.encode.text.bulk"}
    assert stage.local.take([(_job("more", 9), 1.0, lambda out: None)], max_queued_ms=1e9, max_part_ms=1e9) == [False]
    loop_task = asyncio.create_task(stage.core.run(lambda: False))
    stage.gate.set()
    await _until(lambda: stage.core.held == 0, "all answered")
    assert stage.poll_budget() == 4
    stage.intake_gate(stage.poll_budget() == 0)
    assert not paused
    loop_task.cancel()


async def test_the_load_report_counts_what_the_core_holds_and_is_preparing(stage) -> None:
    stage.gate.clear()
    await stage.handle([_record(_job("first", 0), 0)])  # the engine is busy from here
    await _until(lambda: stage.core.direct_ms > 0, "a direct run")
    prep_gate = threading.Event()
    prepare_many = stage.runner.prepare_many
    stage.runner.prepare_many = lambda jobs: (prep_gate.wait(10), prepare_many(jobs))[1]
    await stage.handle([_record(_job("x" * 3000, i), i) for i in range(1, 4)])  # long texts, still tokenizing
    assert stage.report()["queued_rt_ms"] >= stage.core.queued_ms("rt") - 1e-6 > 0
    prep_gate.set()
    await _until(lambda: len(stage.core.queues["rt"]) == 3, "queued")
    report, each = stage.report(), stage.core.model.per_item_ms(3000)  # the prepared length: 3000 here
    assert report["partitions"] == {f"{PREFIX}.encode.text.rt:0": pytest.approx(3 * each, abs=0.01)}
    assert report["queued_rt_ms"] >= 3 * each and report["tenants_rt"] == {"t": pytest.approx(3 * each, abs=0.01)}
    # the scaler's view: the direct run is the batch in service (what is left of its prediction:
    # it may have run past it by now, held at the gate), and four jobs are held in all
    assert 0.0 <= report["running_ms"] <= stage.core.direct_ms and stage.core.direct_ms > 0
    assert report["items"] == 4
    assert report["wait_scale"] == 1.0  # nothing learned yet (no job here carries a predicted wait)
    late = dataclasses.replace(_job("late", 99), predicted_wait_ms=10.0, sent_at_ms=now_ms() - 1000.0)
    stage.core._observe_wait(late, "rt", now_ms())  # noqa: SLF001 - one job that waited 1 s for a predicted 10 ms
    assert stage.report()["wait_scale"] == round(stage.core.waits.factor, 3) > 1.0  # what the router scales by
    loop_task = asyncio.create_task(stage.core.run(lambda: False))
    stage.gate.set()
    await _until(lambda: stage.core.held == 0, "all answered")
    loop_task.cancel()


async def test_the_payload_bytes_held_bound_intake_as_the_job_count_does(stage) -> None:
    stage.max_queue_bytes = 2500  # the fixture's settings say 256 MiB; three 1000-character texts pass it
    stage.gate.clear()
    assert stage.poll_budget() == stage.max_queue
    await stage.handle([_record(_job("x" * 1000, i), i) for i in range(2)])
    assert stage.core.held_bytes == 2000 and stage.poll_budget() == stage.max_queue - 2
    await stage.handle([_record(_job("y" * 1000, 2), 2)])
    assert stage.core.held_bytes == 3000 and stage.poll_budget() == 0  # over the bytes, far under the count
    assert stage.local.take([(_job("z", 9), 1.0, lambda out: None)], max_queued_ms=1e9, max_part_ms=1e9) == [False]
    loop_task = asyncio.create_task(stage.core.run(lambda: False))
    stage.gate.set()
    await _until(lambda: stage.core.held == 0, "all answered")
    assert stage.core.held_bytes == 0 and stage.poll_budget() == stage.max_queue
    loop_task.cancel()
