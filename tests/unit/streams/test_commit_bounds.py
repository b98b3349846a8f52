"""A stage's commit leaves out the partitions of topics the cluster no longer has, and gives up
after ``commit_timeout_s`` on a commit the client would retry for ever (aiokafka retries
UNKNOWN_TOPIC_OR_PARTITION, a deleted topic's answer, without end): the stage can still stop
and rebalance. Nothing finished is lost either way: the work since the last commit repeats.
(On the real broker: tests/integration/test_deleted_topic.py.)"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from streams.runtime.io import IOSettings, StageIO


class Consumer:
    """What ``StageIO.commit`` uses of aiokafka's consumer: the assignment, the cluster's topics
    and ``commit``, which records what it was given, or hangs as a retried error would."""

    def __init__(self, assigned: set[TopicPartition], topics: set[str], hang: bool = False) -> None:
        self.assigned = assigned
        self.looked_up = 0
        self._client = SimpleNamespace(cluster=SimpleNamespace(topics=lambda: self._topics(topics)))
        self.hang = hang
        self.commits: list[dict[TopicPartition, int]] = []

    def _topics(self, topics: set[str]) -> set[str]:
        self.looked_up += 1
        return set(topics)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    async def commit(self, offsets) -> None:
        if self.hang:
            await asyncio.Event().wait()
        self.commits.append({tp: om.offset for tp, om in offsets.items()})


def _io(consumer: Consumer, **settings) -> StageIO:
    io = StageIO(IOSettings("127.0.0.1:1", "g", {}, **settings), [])
    io.consumer = consumer
    io.tracker.assign(consumer.assigned)
    for tp in consumer.assigned:  # one record read and finished on each partition
        io.tracker.take(tp, 0)
        io.tracker.finish(tp, 0)
    return io


async def test_a_deleted_topic_is_left_out_and_the_others_committed() -> None:
    gone, kept = TopicPartition("gone", 0), TopicPartition("kept", 0)
    io = _io(Consumer({gone, kept}, topics={"kept"}))
    await io.commit()
    assert io.consumer.commits == [{kept: 1}]


async def test_when_every_topic_is_gone_nothing_is_sent() -> None:
    io = _io(Consumer({TopicPartition("gone", 0)}, topics=set()))
    await io.commit()
    assert io.consumer.commits == []


async def test_a_commit_the_client_would_retry_for_ever_gives_up_and_is_tried_again() -> None:
    tp = TopicPartition("kept", 0)
    io = _io(Consumer({tp}, topics={"kept"}, hang=True), commit_timeout_s=0.05)
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(io.commit(), 5)
    assert time.monotonic() - started < 1  # its own bound gave up, not this test's
    io.consumer.hang = False
    await io.commit()  # not taken for done: sent again
    assert io.consumer.commits == [{tp: 1}]


async def test_a_stage_stops_though_its_last_commit_hangs() -> None:
    io = _io(Consumer({TopicPartition("kept", 0)}, topics={"kept"}, hang=True), commit_timeout_s=0.05)
    io.consumer.stop = lambda: asyncio.sleep(0)
    await asyncio.wait_for(io.stop(drain_s=0.1), 5)


async def test_an_idle_commit_sends_nothing_and_reads_no_metadata() -> None:
    """Every stage commits every 200 ms; one with nothing new to commit (idle) neither sends a
    commit nor copies the client's topic list (every topic of the cluster's metadata)."""
    tp = TopicPartition("kept", 0)
    io = _io(Consumer({tp}, topics={"kept"}))
    await io.commit()
    assert io.consumer.commits == [{tp: 1}] and io.consumer.looked_up == 1
    await io.commit()
    await io.commit()
    assert io.consumer.commits == [{tp: 1}] and io.consumer.looked_up == 1
    io.tracker.take(tp, 1)
    io.tracker.finish(tp, 1)
    await io.commit()
    assert io.consumer.commits == [{tp: 1}, {tp: 2}] and io.consumer.looked_up == 2
