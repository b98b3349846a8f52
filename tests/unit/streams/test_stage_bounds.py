"""Bounded stage state and loops that survive their own errors: the assembler's pending set
counted apart from tombstones and orphans, orphans bounded by age and count, deadlines from
a heap, and ``RecordStage.supervise`` restarting a task that raised."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import pack
from schemas.jobs import EncodedPart, Manifest
from schemas.settings import Settings
from schemas.trace import now_ms
from streams.app import create_app
from streams.observe.health import WorkerHealth
from streams.observe.metrics import Metrics
from streams.runtime.stage import RecordStage
from streams.stages.assembler import AssemblerStage

PREFIX = "unit"


class Recorder:
    """Stands in for StageIO: what the stage delivered and finished."""

    def __init__(self) -> None:
        self.delivered: list[tuple[list, list]] = []
        self.finished: list[int] = []

    def hold(self, inputs):
        pass

    def deliver(self, outs, inputs=()):
        self.delivered.append((list(outs), list(inputs)))
        self.finished.extend(r.offset for r in inputs)

    def finish(self, inputs):
        self.finished.extend(r.offset for r in inputs)


@pytest.fixture
def assembler(tmp_path):
    env = {"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path),
           "MMSTREAM_ASSEMBLER_MAX_PENDING": "2", "MMSTREAM_ASSEMBLER_MAX_ORPHANS": "2",
           "MMSTREAM_CACHE_WHOLE_RESULT": "false", "MMSTREAM_ASSEMBLER_RETENTION_MS": "1000"}
    settings = Settings.from_env(env)
    stage = AssemblerStage(create_app(settings, "assembler", health=WorkerHealth()), settings,
                           Metrics(health=WorkerHealth()))
    stage.io = Recorder()
    stage.partitions[TopicPartition(f"{PREFIX}.encoded.rt", 0)] = __import__(
        "streams.stages.assembler", fromlist=["PartitionState"]).PartitionState()
    return stage


_offsets = iter(range(10**6))


def _record(msg) -> ConsumerRecord:
    value = pack(msg.to_wire())
    return ConsumerRecord(f"{PREFIX}.encoded.rt", 0, next(_offsets), 0, 0, msg.id.encode(), value, None, 1,
                          len(value), [])


def _manifest(rid: str, deadline_in_ms: float = 60_000, n_parts: int = 1) -> Manifest:
    now = now_ms()
    return Manifest(id=rid, tenant="t", task="embed", n_parts=n_parts, modalities=["text"] * n_parts, lane="rt",
                    reply_to=f"{PREFIX}.results", deadline_at_ms=now + deadline_in_ms, accepted_at_ms=now,
                    client_sent_at_ms=now, sent_at_ms=now)


def _part(rid: str, part: int = 0) -> EncodedPart:
    return EncodedPart(id=rid, part=part, modality="text", sent_at_ms=now_ms(), tenant="t",
                       error={"code": "internal", "message": "x", "retriable": False})


def _kinds(stage: AssemblerStage) -> dict[str, int]:
    part = next(iter(stage.partitions.values()))
    return {"open": part.pending, "orphans": len(part.orphans), "tombstones": len(part.done)}


async def test_pending_counts_open_requests_only_and_past_it_new_ones_are_overloaded(assembler) -> None:
    for rid in ("a", "b"):
        await assembler.handle([_record(_manifest(rid, n_parts=2))])
    await assembler.handle([_record(_part("a", 0)), _record(_part("a", 1))])  # a answered: a tombstone
    assert _kinds(assembler) == {"open": 1, "orphans": 0, "tombstones": 1}
    await assembler.handle([_record(_manifest("c", n_parts=2))])  # b and c: at the bound, not past it
    await assembler.handle([_record(_manifest("d", n_parts=2))])
    errors = [o for outs, _ in assembler.io.delivered for o in outs if b"overloaded" in o.value]
    assert len(errors) == 1 and errors[0].key == b"d"


async def test_orphans_are_bounded_by_count_oldest_first_and_never_answered(assembler) -> None:
    for rid in ("x", "y", "z"):
        await assembler.handle([_record(_part(rid))])
    part = next(iter(assembler.partitions.values()))
    assert list(part.orphans) == ["t/y", "t/z"] and "t/x" not in part.open
    assert assembler.orphans_dropped == 1 and len(assembler.io.finished) == 1  # x's record committable
    assert not [o for outs, _ in assembler.io.delivered for o in outs if o.topic.endswith(".results")]
    assembler.sweep(now_ms() + assembler.policy.orphan_ttl_ms)
    assert not part.orphans and not part.open


async def test_a_manifest_after_its_orphaned_part_adopts_it(assembler) -> None:
    await assembler.handle([_record(_part("late"))])
    await assembler.handle([_record(_manifest("late", n_parts=2))])
    assert _kinds(assembler) == {"open": 1, "orphans": 0, "tombstones": 0}


async def test_deadlines_fire_from_the_heap_and_state_empties_after_retention(assembler) -> None:
    await assembler.handle([_record(_manifest("slow", deadline_in_ms=50, n_parts=2))])
    assembler.sweep(now_ms() + 100)
    terminal = [o for outs, _ in assembler.io.delivered for o in outs
                if o.topic.endswith(".results") and b"deadline_exceeded" in o.value]
    assert len(terminal) == 1
    assert _kinds(assembler) == {"open": 0, "orphans": 0, "tombstones": 1}
    assembler.sweep(now_ms() + 100 + 1000)
    assert _kinds(assembler) == {"open": 0, "orphans": 0, "tombstones": 0}


async def test_a_supervised_task_that_raises_is_logged_and_started_again(assembler, caplog) -> None:
    runs = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("a bug in the loop")
        await asyncio.sleep(10)

    task = asyncio.ensure_future(RecordStage._supervised(assembler, "sweep", flaky))
    await asyncio.sleep(0.5)
    task.cancel()
    assert len(runs) == 3 and assembler.restarts == {"sweep": 2}
    assert "task sweep failed" in caplog.text


class HandingIO:
    """StageIO's bookkeeping of which records of a batch were taken care of."""

    def __init__(self) -> None:
        self.handed: set = set()
        self.delivered: list[tuple[list, list]] = []

    def _mark(self, inputs):
        self.handed.update((r.topic, r.partition, r.offset) for r in inputs)

    def deliver(self, outs, inputs=(), epoch=None):
        inputs = list(inputs)
        self._mark(inputs)
        self.delivered.append((list(outs), inputs))

    def finish(self, inputs):
        self._mark(inputs)

    hold = _mark


class PoisonedStage:
    """A stage whose handler raises on the record with value ``b"poison"``, after it has
    already answered the records before it in the batch."""

    stage = "unit.poisoned"
    handle_isolated = RecordStage.handle_isolated
    _park = RecordStage._park

    def __init__(self) -> None:
        self.io = HandingIO()
        self.handled: list[int] = []

    async def handle(self, records) -> None:
        for r in records:
            if r.value == b"poison":
                raise RuntimeError("a bug " + "x" * 5000)
            self.handled.append(r.offset)
            self.io.deliver([f"answer {r.offset}"], [r])

    def dlq(self, r, reason):
        return f"dlq {r.offset}: {reason[:40]}"


async def test_a_bad_record_is_dead_lettered_alone_and_its_neighbours_are_handled(caplog) -> None:
    stage = PoisonedStage()
    values = [b"ok", b"ok", b"poison", b"ok", b"ok"]
    records = [ConsumerRecord("unit.ingress.rt", 0, i, 0, 0, None, v, None, 1, 2, []) for i, v in enumerate(values)]
    await stage.handle_isolated(records)
    assert stage.handled == [0, 1, 3, 4]  # each answered once: the two before the bad one were not handled again
    parked = [(outs, [r.offset for r in inputs]) for outs, inputs in stage.io.delivered if outs[0].startswith("dlq")]
    assert [inputs for _, inputs in parked] == [[2]] and parked[0][0][0].startswith("dlq 2: internal: unit.poisoned")
    assert "handling its records one at a time" in caplog.text and "record unit.ingress.rt[0]@2 failed alone" in caplog.text
    assert all(len(m) < 800 for m in caplog.messages)  # the exception's text is cut, however long
