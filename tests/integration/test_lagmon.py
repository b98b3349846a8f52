"""Lag read from the real broker follows the commits of a consumer group."""

from __future__ import annotations

import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas.settings import Settings
from streams.observe.lagmon import LagMonitor, measure_lag
from streams.observe.metrics import Metrics

pytestmark = pytest.mark.integration


async def _produce(bootstrap: str, tp: TopicPartition, n: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for i in range(n):
            await producer.send(tp.topic, f"r{i}".encode(), partition=tp.partition)
        await producer.flush()
    finally:
        await producer.stop()


def _rows(rows, group):
    return {(r.topic, r.partition): r for r in rows if r.group == group}


async def test_lag_is_end_minus_committed_and_follows_commits(infra: Settings) -> None:
    bootstrap = infra.kafka.bootstrap
    prefix = f"lag{uuid.uuid4().hex[:10]}"
    topic, group = f"{prefix}.ingress.rt", f"{prefix}-test"
    p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 2, 1)])
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        await _produce(bootstrap, p0, 50)
        await _produce(bootstrap, p1, 7)
        await consumer.start()
        consumer.assign([p0])  # manual assignment: commits without joining the group
        await consumer.commit({p0: 20})

        rows = await measure_lag(bootstrap, prefix)
        assert {r.group for r in rows} == {group}
        mine = _rows(rows, group)
        assert (mine[(topic, 0)].committed, mine[(topic, 0)].end, mine[(topic, 0)].lag) == (20, 50, 30)
        # Never committed on partition 1: everything retained there is still to do.
        assert (mine[(topic, 1)].committed, mine[(topic, 1)].lag) == (None, 7)

        consumer.seek(p0, 20)
        read = 0
        while read < 25:
            batch = await consumer.getmany(p0, timeout_ms=2000, max_records=25 - read)
            read += len(batch.get(p0, []))
        await consumer.commit()  # commits the position: 45

        metrics = Metrics()
        monitor = LagMonitor(bootstrap, prefix, metrics, interval_s=1.0)
        try:
            rows = await monitor.refresh()
        finally:
            await monitor.reader.close()
        assert _rows(rows, group)[(topic, 0)].lag == 5
        gauges = {(s.labels["topic"], s.labels["partition"], s.labels["group"]): s.value
                  for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                  if fam.name == "mmstream_consumer_lag" for s in fam.samples}
        assert gauges == {(topic, "0", group): 5.0, (topic, "1", group): 7.0}
    finally:
        await consumer.stop()
        await admin.delete_topics([topic])
        await admin.close()


async def test_no_groups_of_the_prefix_means_no_rows(infra: Settings) -> None:
    assert await measure_lag(infra.kafka.bootstrap, f"none{uuid.uuid4().hex[:10]}") == []


async def test_members_that_never_committed_count_from_the_log_start(infra: Settings) -> None:
    bootstrap = infra.kafka.bootstrap
    prefix = f"lag{uuid.uuid4().hex[:10]}"
    topic = f"{prefix}.encode.text.rt"
    # Two live groups that subscribe but have committed nothing: found through their
    # subscriptions, since the broker holds no offsets for them. Two, because describing
    # several groups in one request is what trips aiokafka (see LagReader._member_metadata).
    groups = [f"{prefix}-encode-text", f"{prefix}-assembler"]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 1)])
    consumers = [AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=g,
                                  enable_auto_commit=False, auto_offset_reset="latest") for g in groups]
    try:
        await _produce(bootstrap, TopicPartition(topic, 0), 12)
        for consumer in consumers:
            await consumer.start()
            deadline = time.monotonic() + 30
            while not consumer.assignment() and time.monotonic() < deadline:  # joined its group
                await consumer.getmany(timeout_ms=200)
            assert consumer.assignment()
        rows = await measure_lag(bootstrap, prefix)
        for group in groups:
            row = _rows(rows, group)[(topic, 0)]
            assert row.committed is None and row.lag == 12
    finally:
        for consumer in consumers:
            await consumer.stop()
        await admin.delete_topics([topic])
        await admin.close()
