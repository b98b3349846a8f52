"""``streams.runtime.recovery.recover`` on the real broker: a take-over learns which requests
its replay brings back, which of them a done marker says were answered (never redone), and
which events of the others are on their reply topic already (never sent again)."""

from __future__ import annotations

import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.codec import pack
from schemas.events import Event, EventKind
from streams.runtime.recovery import done_marker, recover

pytestmark = pytest.mark.integration


async def _topics(bootstrap: str) -> tuple[str, str, str, str]:
    """A fresh input, done and reply topic (one partition each) and a group name."""
    run = uuid.uuid4().hex[:8]
    inputs, done, replies, group = f"rec{run}.in", f"rec{run}.done", f"rec{run}.results", f"rec{run}-g"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(t, 1, 1) for t in (inputs, done, replies)])
    await admin.close()
    return inputs, done, replies, group


async def test_recover_names_what_was_answered_and_what_was_sent(infra) -> None:
    bootstrap = infra.kafka.bootstrap
    inputs, done, replies, group = await _topics(bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    now = time.time() * 1000
    try:
        for rid in ("answered", "half", "untouched"):
            await producer.send_and_wait(inputs, rid.encode(), key=rid.encode(), partition=0)
        marker = done_marker(done, "t/answered", replies, now)
        await producer.send_and_wait(done, marker.value, key=marker.key, partition=0)
        accepted = Event(id="half", kind=EventKind.ACCEPTED, seq=0, ts_ms=now)
        await producer.send_and_wait(replies, pack(accepted.to_wire()), key=b"half")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(inputs, 0)
        got = await recover(consumer, bootstrap, {}, 1 << 20, done, {tp},
                            lambda r: (f"t/{r.key.decode()}", replies, r.key.decode()), now + 1000, 60_000)
    finally:
        await consumer.stop()
    assert set(got.done[tp]) == {"t/answered"}
    assert got.replayed == {"t/half", "t/untouched"}  # the answered one is not redone
    assert got.sent == {"t/half": {("accepted", 0)}}  # its accepted is not sent again


async def test_markers_older_than_the_retention_are_not_read(infra, monkeypatch) -> None:
    """The done topic keeps markers an hour; a take-over needs those of its retention window
    only, and reads the marker partition from the first record younger than it."""
    from streams.runtime.replies import BrokerReader

    bootstrap = infra.kafka.bootstrap
    inputs, done, replies, group = await _topics(bootstrap)
    now = time.time() * 1000
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(5):  # answered 10 minutes ago, stamped then
            old = done_marker(done, f"t/old{i}", replies, now - 600_000)
            await producer.send_and_wait(done, old.value, key=old.key, partition=0, timestamp_ms=int(now - 600_000))
        fresh = done_marker(done, "t/fresh", replies, now - 1000)
        await producer.send_and_wait(done, fresh.value, key=fresh.key, partition=0)
    finally:
        await producer.stop()
    asked: list[dict] = []
    read_ranges = BrokerReader.read_ranges

    async def spy(self, ranges):
        asked.append(dict(ranges))
        return await read_ranges(self, ranges)

    monkeypatch.setattr(BrokerReader, "read_ranges", spy)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(inputs, 0)
        got = await recover(consumer, bootstrap, {}, 1 << 20, done, {tp},
                            lambda r: (f"t/{r.key.decode()}", replies, r.key.decode()), now, 120_000)
    finally:
        await consumer.stop()
    assert set(got.done[tp]) == {"t/fresh"}
    assert asked[0] == {TopicPartition(done, 0): (5, 6)}  # the fresh marker only, not the five before it
