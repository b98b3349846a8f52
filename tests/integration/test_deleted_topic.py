"""A topic deleted under a running stage, on the real broker: the stage's commits skip it and
are bounded, so the stage goes on committing its other topics and stops when told.

aiokafka retries a retriable commit error for ever, and a deleted topic answers every commit
with one (UNKNOWN_TOPIC_OR_PARTITION). Before ``StageIO.commit`` was bounded, a stage told to
stop after its topic was deleted (a broker that came back without it, an operator's
``kafka-topics --delete``) never exited: it retried that commit ten times a second and its
consumer logged "not found in cluster metadata" thousands of times a second (a 167 MB log in
eight minutes, found with a bench's router left behind when the bench was killed)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.settings import Settings
from streams.runtime.io import IOSettings, StageIO

pytestmark = pytest.mark.integration


async def test_a_stage_whose_topic_was_deleted_commits_the_others_and_stops(infra: Settings) -> None:
    bootstrap = infra.kafka.bootstrap
    run = uuid.uuid4().hex[:8]
    gone, kept = f"deleted-{run}", f"kept-{run}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(gone, 1, 1), NewTopic(kept, 1, 1)])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    for topic in (gone, kept):
        await producer.send_and_wait(topic, b"x", partition=0)
    await producer.stop()
    # The test commits itself (the periodic commit would commit both before the deletion).
    io = StageIO(IOSettings(bootstrap, f"g-{run}", {}, commit_timeout_s=2.0, metadata_max_age_ms=1000,
                            commit_interval_s=3600.0), [gone, kept])
    stopped = False
    try:
        await io.start()
        records = []
        deadline = time.monotonic() + 60
        while len(records) < 2 and time.monotonic() < deadline:
            records += await io.poll(200)
        assert {r.topic for r in records} == {gone, kept}
        io.finish(records)  # both commit points move to 1
        await admin.delete_topics([gone])

        committed = None
        deadline = time.monotonic() + 30
        while committed != 1 and time.monotonic() < deadline:
            started = time.monotonic()
            try:
                await asyncio.wait_for(io.commit(), 10)  # bounded by commit_timeout_s, not by this
            except asyncio.TimeoutError:
                assert time.monotonic() - started < 5  # the stage's own bound gave up, not wait_for
            except Exception:  # noqa: BLE001 - the group rebalancing away from the deleted topic
                pass
            committed = await io.consumer.committed(TopicPartition(kept, 0))
            await io.poll(100)
        assert committed == 1  # the surviving topic's progress is kept

        await asyncio.wait_for(io.stop(drain_s=1.0), 30)  # it stops: no commit holds it
        stopped = True
    finally:
        if not stopped:  # close the clients without the commit that would hang
            consumer, io.consumer = io.consumer, None
            await io.stop(drain_s=0.1)
            if consumer is not None:
                await asyncio.wait_for(consumer.stop(), 10)
        await admin.delete_topics([kept])
        await admin.close()
