"""What a stage that answers clients finds on the broker when it takes over partitions.

A stage that owns a request's answer (the assembler, the generator) keeps its requests in
memory and finishes their input records only once they are answered. After a crash or a
rebalance, the new owner reads again every record past the committed offset, which rebuilds
the state — and would answer again what the last owner had answered but not yet committed.
Before it does anything, it asks this module two questions:

- ``read_ranges``: the records of partitions between two offsets each, all in one pass (to
  learn which requests the replay will bring back, before the replay starts);
- ``events_on_replies``: which events (kind, seq) of those requests are on their reply
  topics already, reading each reply partition once from a time before the oldest of them.

Both read with a consumer of their own (no group, no commits). Reply partitions are found
the way the producer chose them: the default partitioner over the topic's partitions.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.events import Event
from streams.runtime.clients import close_quietly

log = logging.getLogger(__name__)

_partitioner = DefaultPartitioner()
CLOCK_SKEW_MS = 5_000.0


class BrokerReader:
    """A group-less consumer for one-off reads (recovery)."""

    def __init__(self, bootstrap: str, client_kwargs: dict[str, Any], max_bytes: int = 8 * 1024 * 1024) -> None:
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                         max_partition_fetch_bytes=max_bytes, fetch_max_wait_ms=50, **client_kwargs)
        self._cluster: Any = None

    async def __aenter__(self) -> "BrokerReader":
        try:
            await self.consumer.start()
        except BaseException:  # __aexit__ is not called for a failed __aenter__
            await close_quietly(self.consumer)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def read_ranges(self, ranges: dict[TopicPartition, tuple[int, int]]) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Per partition, its records with ``start <= offset < end``, all read in one pass:
        every partition assigned at once, so each fetch brings records of many of them (a
        take-over reads every partition it was given; read one by one, that cost a round trip
        or more each, ~25 ms here, and grew with the tenants' topics past the session timeout)."""
        out: dict[TopicPartition, list[ConsumerRecord]] = {tp: [] for tp in ranges}
        left = {tp: end for tp, (start, end) in ranges.items() if end > start}
        if not left:
            return out
        self.consumer.assign(list(left))
        for tp in left:
            self.consumer.seek(tp, ranges[tp][0])
        while left:
            batch = await self.consumer.getmany(*left, timeout_ms=500, max_records=10_000)
            for tp, records in batch.items():
                if tp in left:
                    out[tp].extend(r for r in records if r.offset < left[tp])
            stalled = [tp for tp in left if not batch.get(tp)]
            latest = await self.consumer.end_offsets(stalled) if stalled else {}
            for tp in list(left):
                position = await self.consumer.position(tp)
                # Done at its end, or where nothing came and nothing is left to come (records
                # deleted by retention meanwhile: the end seen before is past what is there).
                if position >= left[tp] or (tp in latest and position >= latest[tp]):
                    del left[tp]
        return out

    async def reply_partition(self, topic: str, key: bytes) -> TopicPartition | None:
        if self._cluster is None or self._cluster.partitions_for_topic(topic) is None:
            # A topic this consumer never assigned is not in its own metadata: ask for all.
            self._cluster = await self.consumer._client.fetch_all_metadata()  # noqa: SLF001
        parts = self._cluster.partitions_for_topic(topic)
        if not parts:
            return None
        ordered = sorted(parts)
        return TopicPartition(topic, _partitioner(key, ordered, ordered))

    async def events_on_replies(self, wanted: Iterable[tuple[str, bytes, float]]
                                ) -> dict[tuple[str, bytes], set[tuple[str, int]]]:
        """For (reply topic, request key, earliest ms it can have been answered) triples:
        the (kind, seq) of every event of those keys now on their reply topics, by (reply
        topic, key) (the same id may be another tenant's request on another topic)."""
        by_tp: dict[TopicPartition, tuple[set[bytes], float]] = {}
        for topic, key, since in wanted:
            tp = await self.reply_partition(topic, key)
            if tp is None:
                continue
            keys, earliest = by_tp.get(tp, (set(), since))
            keys.add(key)
            by_tp[tp] = (keys, min(earliest, since))
        found: dict[tuple[str, bytes], set[tuple[str, int]]] = {}
        if not by_tp:
            return found
        self.consumer.assign(list(by_tp))
        starts = await self.consumer.offsets_for_times({tp: max(0, int(since - CLOCK_SKEW_MS))
                                                        for tp, (_, since) in by_tp.items()})
        ends = await self.consumer.end_offsets(list(by_tp))
        records = await self.read_ranges({tp: (starts[tp].offset if starts.get(tp) else ends[tp], ends[tp])
                                          for tp in by_tp})  # every reply partition in one pass
        for tp, (keys, _) in by_tp.items():
            for r in records[tp]:
                if r.key not in keys:
                    continue
                try:
                    ev = Event.from_wire(unpack(r.value))
                except (DecodeError, ValueError, TypeError):
                    continue
                found.setdefault((tp.topic, r.key), set()).add(("terminal" if ev.terminal else str(ev.kind), ev.seq))
        return found
