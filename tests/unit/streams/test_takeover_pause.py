"""A partition being taken over stays paused until the stage's ``on_assigned`` returned, even
when the stage pauses and resumes its topics for flow control meanwhile (the generator does
after every step): a record let in early would be run before recovery learned what the last
owner already sent, and its events sent twice."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from streams.runtime.io import IOSettings, StageIO, _Listener


class Consumer:
    """The three calls of aiokafka's consumer that pausing uses; records which are paused."""

    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = set(assigned)
        self.paused: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= set(tps)


async def test_flow_control_does_not_resume_a_partition_being_taken_over() -> None:
    old, new = TopicPartition("p.generate.rt", 0), TopicPartition("p.generate.rt", 1)
    seen_paused: list[set[TopicPartition]] = []
    release = asyncio.Event()

    async def on_assigned(tps: set[TopicPartition]) -> None:
        io.resume("p.generate.rt")  # the stage's own flow control, while recovery runs
        seen_paused.append(set(io.consumer.paused))
        await release.wait()

    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["p.generate.rt"], on_assigned=on_assigned)
    io.consumer = Consumer({old, new})
    io.consumer.pause(old)  # paused by the stage before: flow control may resume it
    takeover = asyncio.ensure_future(_Listener(io).on_partitions_assigned({new}))
    await asyncio.sleep(0)
    assert seen_paused == [{new}]
    release.set()
    await takeover
    assert io.consumer.paused == set()
