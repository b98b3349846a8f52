"""Reading topics directly, to check what is on the wire (not what the SDK deduplicates)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.codec import unpack
from schemas.events import Event


async def read_to_end(bootstrap: str, topic: str) -> list:
    """Every record of ``topic`` from the beginning up to its end offsets at call time."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        tps = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
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


async def terminal_events(bootstrap: str, topic: str, ids: set[str], timeout_s: float = 90.0,
                          settle_s: float = 2.0) -> dict[str, list[Event]]:
    """Terminal events per id on the wire. Waits until every id has one (or the timeout),
    then ``settle_s`` more, so that a duplicate sent shortly after is seen too."""

    def collect(records: list) -> dict[str, list[Event]]:
        found: dict[str, list[Event]] = defaultdict(list)
        for r in records:
            ev = Event.from_wire(unpack(r.value))
            if ev.terminal and ev.id in ids:
                found[ev.id].append(ev)
        return found

    deadline = time.monotonic() + timeout_s
    found = collect(await read_to_end(bootstrap, topic))
    while not ids <= set(found) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        found = collect(await read_to_end(bootstrap, topic))
    await asyncio.sleep(settle_s)
    return dict(collect(await read_to_end(bootstrap, topic)))
