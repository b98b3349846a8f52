"""Reading a topic from the beginning to its current end: what is on the wire, for checks
(chaos runs, tests, tools), not for serving."""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition


async def read_to_end(bootstrap: str, topic: str, client_kwargs: dict[str, Any] | None = None) -> list:
    """Every record of ``topic`` from the beginning up to its end offsets at call time
    (``client_kwargs``: security options, ``streams.connection.client_kwargs``)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                **(client_kwargs or {}))
    try:
        await consumer.start()
        await consumer._client.force_metadata_update()  # a fresh client may not know the topic yet
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        if not tps:
            return []
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        records: list = []
        remaining = {tp for tp in tps if ends[tp] > 0}
        while remaining:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(recs)
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        return records
    finally:
        await consumer.stop()


async def contains(bootstrap: str, topic: str, key: bytes, value: bytes, since_ms: float,
                   client_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``topic`` holds a record with exactly this key and value, written at or after
    ``since_ms`` (epoch ms). Reads every partition from that time to its current end."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                **(client_kwargs or {}))
    try:
        await consumer.start()
        await consumer._client.force_metadata_update()
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or set())]
        if not tps:
            return False
        consumer.assign(tps)
        starts = await consumer.offsets_for_times({tp: int(since_ms) for tp in tps})
        ends = await consumer.end_offsets(tps)
        remaining = set()
        for tp in tps:
            start = starts.get(tp)
            if start is not None and start.offset < ends[tp]:
                consumer.seek(tp, start.offset)
                remaining.add(tp)
        while remaining:
            for recs in (await consumer.getmany(*remaining, timeout_ms=500)).values():
                if any(r.key == key and r.value == value for r in recs):
                    return True
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        return False
    finally:
        await consumer.stop()
