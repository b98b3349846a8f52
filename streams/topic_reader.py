"""Reading a topic from the beginning to its current end: what is on the wire, for checks
(chaos runs, tests, tools), not for serving."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition


async def read_to_end(bootstrap: str, topic: str) -> list:
    """Every record of ``topic`` from the beginning up to its end offsets at call time."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
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
