"""Failover on a real broker of the test's own (mmstream.chaos.infra.OwnKafka, with the local
brokers' failover settings): a stage that starts while its broker is away waits for it
instead of exiting, and a replica that dies without leaving its group loses its partitions
to the other replica after its (short) session, which the broker accepts."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmstream.chaos.infra import OwnKafka
from schemas.settings import Settings
from streams.runtime.io import IOSettings, StageIO

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_kafka(tmp_path):
    kafka = OwnKafka(Settings.from_env({}), REPO, tmp_path)
    yield kafka
    kafka.stop()


async def test_a_stage_started_before_its_broker_waits_for_it(own_kafka) -> None:
    io = StageIO(IOSettings(own_kafka.bootstrap, f"g-{uuid.uuid4().hex[:6]}", {}), [f"t-{uuid.uuid4().hex[:6]}"])
    starting = asyncio.create_task(io.start())
    await asyncio.sleep(1.0)
    assert not starting.done()  # still trying, not exited
    await asyncio.to_thread(own_kafka.start)
    await asyncio.wait_for(starting, 120)
    assert io.consumer is not None and io.producer is not None
    await io.stop(drain_s=1.0)


async def test_a_dead_replicas_partitions_move_after_a_short_session(own_kafka) -> None:
    await asyncio.to_thread(own_kafka.start)
    topic, group = f"t-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=own_kafka.bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 4, 1)])
    await admin.close()
    settings = IOSettings(own_kafka.bootstrap, group, {}, session_timeout_ms=3000, heartbeat_interval_ms=500)
    a, b = StageIO(settings, [topic]), StageIO(settings, [topic])
    try:
        await a.start()
        await b.start()
        everything = {TopicPartition(topic, p) for p in range(4)}

        async def until(cond) -> None:
            while not cond():
                await a.poll(100)
                await b.poll(100)

        await asyncio.wait_for(until(lambda: a.assignment() | b.assignment() == everything and a.assignment()
                                     and b.assignment()), 60)
        # b dies without a word to the broker: its heartbeats stop, it never leaves the group.
        b.consumer._coordinator._heartbeat_task.cancel()  # noqa: SLF001
        b.consumer._coordinator._coordination_task.cancel()  # noqa: SLF001

        async def only_a() -> None:
            while a.assignment() != everything:
                await a.poll(100)

        await asyncio.wait_for(only_a(), 60)  # the session (3 s) ran out: a has them all
    finally:
        try:
            await a.stop(drain_s=1.0)
        finally:  # b's too: its coordinator is dead, so its stop may fail; its connections must not stay
            if b._commit_task is not None:  # noqa: SLF001
                b._commit_task.cancel()  # noqa: SLF001
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await b._commit_task  # noqa: SLF001
            for client in (b.consumer, b.producer):
                if client is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(client.stop(), 10)
