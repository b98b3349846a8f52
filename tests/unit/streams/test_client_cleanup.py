"""A Kafka client that was created is stopped on every path that does not hand it on: a start
that fails for any reason (not only an unreachable broker), a start cancelled or timed out, a
seek after the clients started, a stop whose first half fails. Otherwise its connections and
tasks stay open for the life of the process (a user's process, with the SDK). Fake clients
stand in for aiokafka's here: what is tested is which of them are stopped."""

from __future__ import annotations

import asyncio

import aiokafka
import pytest
from aiokafka.errors import KafkaConnectionError

from streams.runtime.clients import start_when_reachable
from streams import reply_topics
from streams.runtime import io as stage_io
from streams.runtime.io import IOSettings, StageIO
from streams.sdk.client import Client
from streams.sdk.transport import KafkaTransport


class Fake:
    """A client whose ``start`` (or seek, or ``stop``) does what a test says."""

    made: list["Fake"] = []

    def __init__(self, *args, start: BaseException | None = None, seek: BaseException | None = None,
                 stop: BaseException | None = None, hang: bool = False, **kwargs) -> None:
        self.start_error, self.seek_error, self.stop_error, self.hang = start, seek, stop, hang
        self.stopped = False
        Fake.made.append(self)

    async def start(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.start_error is not None:
            raise self.start_error

    async def stop(self) -> None:
        self.stopped = True
        if self.stop_error is not None:
            raise self.stop_error

    # what KafkaTransport.start asks of its consumer
    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    def assign(self, tps) -> None:
        pass

    async def seek_to_end(self, *tps) -> None:
        if self.seek_error is not None:
            raise self.seek_error

    async def position(self, tp) -> int:
        return 0


async def test_a_start_that_fails_otherwise_than_unreachable_stops_its_client() -> None:
    made: list[Fake] = []
    with pytest.raises(ValueError):
        await start_when_reachable(lambda: made.append(Fake(start=ValueError("bad config"))) or made[-1], "test")
    assert [c.stopped for c in made] == [True]


async def test_a_start_cancelled_stops_its_client() -> None:
    made: list[Fake] = []
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(start_when_reachable(lambda: made.append(Fake(hang=True)) or made[-1], "test"), 0.05)
    assert [c.stopped for c in made] == [True]


async def test_an_unreachable_broker_is_tried_again_and_each_try_stopped() -> None:
    made: list[Fake] = []

    def make() -> Fake:
        made.append(Fake(start=KafkaConnectionError("away") if len(made) < 2 else None))
        return made[-1]

    client = await start_when_reachable(make, "test", timeout_s=5)
    assert client is made[-1] and [c.stopped for c in made] == [True, True, False]


def _fake_kafka(monkeypatch, consumer: dict, producer: dict | None = None) -> list[Fake]:
    Fake.made = []
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", lambda *a, **k: Fake(**consumer))
    monkeypatch.setattr(aiokafka, "AIOKafkaProducer", lambda *a, **k: Fake(**(producer or {})))
    return Fake.made


async def test_the_sdk_transport_closes_both_clients_when_its_seek_fails(monkeypatch) -> None:
    made = _fake_kafka(monkeypatch, consumer={"seek": RuntimeError("topic deleted meanwhile")})
    with pytest.raises(RuntimeError):
        await KafkaTransport("127.0.0.1:1").start("replies")
    assert len(made) == 2 and all(c.stopped for c in made)


async def test_the_sdk_transport_stops_its_producer_when_the_consumers_stop_fails(monkeypatch) -> None:
    made = _fake_kafka(monkeypatch, consumer={"stop": RuntimeError("connection reset")})
    transport = KafkaTransport("127.0.0.1:1")
    await transport.start("replies")
    with pytest.raises(RuntimeError):
        await transport.close()
    assert len(made) == 2 and all(c.stopped for c in made)


async def test_a_stage_whose_consumer_cannot_start_leaves_no_producer(monkeypatch) -> None:
    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["t"])
    producer = Fake()
    consumers: list[Fake] = []

    async def new_producer() -> Fake:
        return producer

    monkeypatch.setattr(io, "_new_producer", new_producer)
    monkeypatch.setattr(stage_io, "AIOKafkaConsumer",
                        lambda *a, **k: consumers.append(Fake(start=ValueError("bad consumer config"))) or consumers[-1])
    with pytest.raises(ValueError):
        await io.start()
    assert producer.stopped and io.producer is None and [c.stopped for c in consumers] == [True]


async def test_a_client_whose_start_fails_closes_what_it_opened() -> None:
    class Transport:
        closed = 0

        async def start(self, reply_to: str) -> None:
            raise asyncio.CancelledError()  # a start cancelled half-way (a caller's timeout)

        async def close(self) -> None:
            Transport.closed += 1

    with pytest.raises(asyncio.CancelledError):
        await Client("127.0.0.1:1", transport=Transport()).start()
    assert Transport.closed == 1


async def test_a_stage_stops_its_producer_when_its_consumers_stop_fails() -> None:
    io = StageIO(IOSettings("127.0.0.1:1", "g", {}), ["t"])
    io.consumer, io.producer = Fake(stop=RuntimeError("connection reset")), Fake()
    io.consumer.assignment = lambda: set()
    with pytest.raises(RuntimeError):
        await io.stop(drain_s=0.1)
    assert io.producer.stopped


async def test_the_reply_topic_cache_tries_a_fresh_admin_client_after_a_failed_start(monkeypatch) -> None:
    """The router's reply-topic check: an admin client whose start failed (the broker away) is
    closed and not kept, so the next check starts a fresh one instead of using a dead one."""
    admins: list = []

    class Admin:
        def __init__(self, **kwargs) -> None:
            self.closed = False
            self.fails = not admins  # the first one cannot reach the broker
            admins.append(self)

        async def start(self) -> None:
            if self.fails:
                raise KafkaConnectionError("away")

        async def close(self) -> None:
            self.closed = True

        async def list_topics(self) -> list[str]:
            assert not self.fails, "a client whose start failed was used"
            return ["mm.results.t1"]

    monkeypatch.setattr(reply_topics, "AIOKafkaAdminClient", Admin)
    cache = reply_topics.TopicCache("127.0.0.1:1", ttl_s=0)
    with pytest.raises(KafkaConnectionError):
        await cache.exists("mm.results.t1")
    assert await cache.exists("mm.results.t1")
    assert [a.closed for a in admins] == [True, False]
