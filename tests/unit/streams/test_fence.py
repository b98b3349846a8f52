"""A stalled replica sends nothing for partitions it may have lost (streams/runtime/fence.py),
and output of a revoked assignment is never sent again (streams/runtime/io.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.producer.message_accumulator import MessageAccumulator
from aiokafka.producer.transaction_manager import TransactionManager
from aiokafka.structs import ConsumerRecord

from streams.runtime.produce import Out
from streams.runtime.fence import FencedError, Lease, ProducerGate, watch_coordinator
from streams.runtime.io import IOSettings, StageIO

TP = TopicPartition("t", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_lease_is_held_until_the_margin_before_the_session_ends() -> None:
    clock = Clock()
    lease = Lease(30.0, 10.0, clock)
    assert not lease.held()  # not a member yet
    lease.renew(100.0)
    clock.now = 119.9
    assert lease.held()
    clock.now = 120.0  # the broker keeps the member until 130 at least; stop sending 10 s before
    assert not lease.held()
    lease.renew(115.0)  # a heartbeat sent at 115 was accepted
    assert lease.held() and lease.expires_at() == 135.0
    lease.renew(101.0)  # an older request answered late never moves the lease back
    assert lease.expires_at() == 135.0
    lease.lose()
    assert not lease.held()
    with pytest.raises(ValueError):
        Lease(10.0, 10.0)


def test_a_lease_held_again_calls_back_once() -> None:
    clock = Clock()
    lease = Lease(30.0, 10.0, clock)
    calls = []
    lease.on_held = lambda: calls.append(clock.now)
    lease.renew(100.0)
    lease.renew(101.0)  # still held: no call
    clock.now = 200.0
    lease.renew(199.0)
    assert calls == [100.0, 200.0]


async def test_the_coordinator_hooks_renew_on_accepted_and_lose_on_reset() -> None:
    clock = Clock()
    lease = Lease(30.0, 10.0, clock)
    answers = iter([True, False, False])

    class Coordinator:
        member_id = "m-1"

        async def _do_heartbeat(self) -> bool:
            clock.now += 0.5  # the answer comes after the request was sent
            ok = next(answers)
            if not ok and clock.now > 102:
                self.member_id = ""  # what reset_generation() does
            return ok

        async def _do_rejoin_group(self, subscription: object) -> bool:
            return True

    coordinator = Coordinator()
    watch_coordinator(SimpleNamespace(_coordinator=coordinator), lease)
    assert await coordinator._do_rejoin_group(None) and lease.renewed_at == 100.0
    clock.now = 101.0
    await coordinator._do_heartbeat()
    assert lease.renewed_at == 101.0  # timed from the send, not the answer
    clock.now = 101.0
    await coordinator._do_heartbeat()  # a transient failure: the lease stands
    assert lease.renewed_at == 101.0
    clock.now = 105.0
    await coordinator._do_heartbeat()  # unknown member: lost
    assert lease.renewed_at is None


def test_the_hooked_aiokafka_methods_exist() -> None:
    # fence.py wraps these private names of the pinned aiokafka: a version that renames
    # them must fail here, not silently leave the stages unfenced.
    assert callable(GroupCoordinator._do_heartbeat) and callable(GroupCoordinator._do_rejoin_group)
    assert callable(MessageAccumulator.drain_by_nodes)


class Cluster:
    def leader_for_partition(self, tp: TopicPartition) -> int:
        return 0


async def _producer_with_one_record() -> tuple[SimpleNamespace, asyncio.Future]:
    txn = TransactionManager(None, 60000)
    txn.set_pid_and_epoch(7, 0)
    acc = MessageAccumulator(Cluster(), 16384, 0, 30.0, txn_manager=txn)
    fut = await acc.add_message(TP, b"k", b"v", timeout=1.0)
    return SimpleNamespace(_message_accumulator=acc), fut


async def test_the_gate_holds_batches_while_ownership_is_in_doubt_and_releases_them() -> None:
    clock = Clock()
    lease = Lease(30.0, 10.0, clock)
    gate = ProducerGate(lease)
    producer, _ = await _producer_with_one_record()
    gate.install(producer)
    acc = producer._message_accumulator
    nodes, _ = acc.drain_by_nodes(ignore_nodes=set())
    assert nodes == {} and TP in acc._batches and gate.holding  # no lease yet: held
    waiter = acc.waiter()
    lease.renew(clock.now)  # a heartbeat accepted: the sender is woken and drains
    assert waiter.done() and not gate.holding
    nodes, _ = acc.drain_by_nodes(ignore_nodes=set())
    assert TP in nodes[0]


async def test_discarding_fails_held_batches_without_spending_sequence_numbers() -> None:
    lease = Lease(30.0, 10.0, Clock())
    gate = ProducerGate(lease)
    producer, fut = await _producer_with_one_record()
    gate.install(producer)
    producer._message_accumulator.drain_by_nodes(ignore_nodes=set())
    assert gate.discard() is False  # never drained: the next batch reuses its sequence number
    with pytest.raises(FencedError):
        await fut
    assert gate.discarded == 1 and not producer._message_accumulator._batches


class FakeProducer:
    """Sends nothing; each send's future is resolved by the test."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.futures: list[asyncio.Future] = []

    async def send(self, topic: str, value: bytes, **kw: object) -> asyncio.Future:
        self.sent.append((topic, value))
        fut = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        return fut


def _record(offset: int) -> ConsumerRecord:
    return ConsumerRecord(TP.topic, TP.partition, offset, 0, 0, b"k", b"v", None, 1, 1, [])


async def test_output_failed_after_a_revoke_is_not_sent_again_nor_its_input_finished() -> None:
    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["t"])
    io.producer = FakeProducer()
    io.lease.renew(io.lease.clock())
    io.tracker.assign([TP])
    io.tracker.take(TP, 5)
    task = io.deliver([Out("replies", b"k", b"answer")], [_record(5)])
    await asyncio.sleep(0)
    io.settings = IOSettings("127.0.0.1:1", "g", {}, revoke_drain_s=0.01)
    await io.settle_before_revoke()  # the answer is still unsent: the partitions go
    io.producer.futures[0].set_exception(FencedError("dropped"))
    await asyncio.wait_for(task, 1.0)
    assert io.producer.sent == [("replies", b"answer")]  # not a second time
    assert io.tracker.commit_point(TP) == 5 and io.dropped == 1  # the next owner repeats offset 5


async def test_output_fenced_while_the_partitions_stay_is_sent_again() -> None:
    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["t"])
    io.producer = FakeProducer()
    io.tracker.assign([TP])
    io.tracker.take(TP, 5)
    task = io.deliver([Out("replies", b"k", b"answer")], [_record(5)])
    await asyncio.sleep(0)
    io.producer.futures[0].set_exception(FencedError("held, then dropped with the producer"))
    await asyncio.sleep(0.4)  # the retry backoff
    io.producer.futures[1].set_result(None)
    await asyncio.wait_for(task, 1.0)
    assert len(io.producer.sent) == 2 and io.tracker.commit_point(TP) == 6
