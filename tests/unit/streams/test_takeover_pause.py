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
    await asyncio.wait_for(_Listener(io).on_partitions_assigned({new}), 1.0)
    await asyncio.sleep(0)
    assert seen_paused == [{new}]
    release.set()
    await asyncio.gather(*io._takeovers)
    assert io.consumer.paused == set()


async def test_the_rebalance_callback_returns_before_a_long_take_over_and_its_partitions_wait_paused() -> None:
    """The client heartbeats only once the callback returned: a take-over that outlasted the
    session inside it got the member evicted, and the next rebalance's take-over again."""
    tp = TopicPartition("p.ingress.rt.t1", 0)
    release, taken = asyncio.Event(), []

    async def on_assigned(tps: set[TopicPartition]) -> None:
        await release.wait()
        taken.append(set(tps))

    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["p.ingress.rt"], on_assigned=on_assigned)
    io.consumer = Consumer({tp})
    await asyncio.wait_for(_Listener(io).on_partitions_assigned({tp}), 1.0)  # returns with the take-over running
    assert io.consumer.paused == {tp} and taken == [] and len(io._takeovers) == 1
    io.resume("p.ingress.rt.t1")  # flow control meanwhile
    assert io.consumer.paused == {tp}
    release.set()
    await asyncio.gather(*io._takeovers)
    assert taken == [{tp}] and io.consumer.paused == set() and not io._takeovers


async def test_a_revoke_cancels_a_take_over_still_running_before_the_stage_hears_of_it() -> None:
    tp = TopicPartition("p.ingress.rt.t1", 0)
    events: list[str] = []

    async def on_assigned(tps: set[TopicPartition]) -> None:
        try:
            await asyncio.Event().wait()  # recovery reading, never done
        except asyncio.CancelledError:
            events.append("take-over cancelled")
            raise

    async def on_revoked(tps: set[TopicPartition]) -> None:
        events.append("revoked")

    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["p.ingress.rt"], on_assigned=on_assigned, on_revoked=on_revoked)
    io.consumer = Consumer({tp})
    listener = _Listener(io)
    await asyncio.wait_for(listener.on_partitions_assigned({tp}), 1.0)
    await asyncio.sleep(0)
    io.consumer.commit = _no_commit  # the revoke commits what is finished (nothing here)
    await listener.on_partitions_revoked({tp})
    assert events == ["take-over cancelled", "revoked"] and not io._takeovers and not io._taking_over


async def _no_commit(offsets) -> None:
    raise AssertionError("nothing was finished: nothing to commit")
