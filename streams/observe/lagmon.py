"""Consumer lag of the pipeline's stages, read from the broker: for every consumer group
``<prefix>-<stage>`` and every ``<prefix>.*`` topic it consumes, end offset minus committed
offset, per partition.

Lag is what a stage still has to do, so it is the signal to scale a stage on (KEDA reads
the same numbers) and the first thing to look at when latency grows. It is read from the
broker, not from the workers, so it stays right when a worker is stuck or dead.

A group consumes a topic if it has committed an offset on it or a live member subscribes
to it; the second catches a stage that has not committed anything yet, whose partitions
then count from the log start (``committed`` is None).

``lag_rows`` and ``consumed_topics`` are pure; ``LagReader`` does the Kafka calls;
``LagMonitor`` refreshes the ``mmstream_consumer_lag`` gauges of a ``Metrics`` every few
seconds; ``run_lag_monitor`` is the entry point of the ``lagmon`` process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable, NamedTuple

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.errors import KafkaError

from schemas.settings import Settings
from streams.observe.health import process_health
from streams.observe.http import serve
from streams.observe.metrics import Metrics
from streams.connection import client_kwargs

log = logging.getLogger(__name__)

STAGE = "lagmon"
DEFAULT_INTERVAL_S = 5.0


class LagRow(NamedTuple):
    """Lag of one consumer group on one partition."""

    group: str
    """Consumer group id, ``<prefix>-<stage>``."""
    topic: str
    partition: int
    committed: int | None
    """Next offset the group will read, as committed; None if it never committed here."""
    end: int
    """Offset the next record written to the partition will get (high watermark)."""
    lag: int
    """Records between what the group committed (or the log start) and ``end``; >= 0."""


def lag_rows(group: str, committed: Mapping[TopicPartition, int],
             beginnings: Mapping[TopicPartition, int], ends: Mapping[TopicPartition, int]) -> list[LagRow]:
    """One row per partition in ``ends``, sorted by topic and partition.

    ``committed`` maps partitions to committed offsets; a missing one or a negative offset
    (Kafka's "none") means no commit, and the lag counts from ``beginnings`` (the log
    start): a new group will read everything still retained. A commit below the log start
    (retention deleted what the group had not read) also counts from the log start, because
    those records can no longer be consumed. Lag is never negative: end offsets are read
    after commits, so a commit past them is a race, not work.
    """
    rows = []
    for tp in sorted(ends, key=lambda tp: (tp.topic, tp.partition)):
        end = ends[tp]
        start = beginnings.get(tp, 0)
        offset = committed.get(tp)
        done = None if offset is None or offset < 0 else offset
        lag = max(0, end - max(start, done if done is not None else start))
        rows.append(LagRow(group, tp.topic, tp.partition, done, end, lag))
    return rows


def consumed_topics(topic_prefix: str, committed: Iterable[TopicPartition], subscribed: Iterable[str]) -> set[str]:
    """The pipeline topics (``<prefix>.*``) a group has committed on or subscribes to.

    Faust's own topics (changelogs ``<prefix>-<stage>-<table>-changelog``, the assignor's
    leader topic) are left out: they are restored by assignment, not consumed by offset.
    """
    topics = {tp.topic for tp in committed} | set(subscribed)
    return {t for t in topics if t.startswith(f"{topic_prefix}.")}


def pipeline_groups(topic_prefix: str, groups: Iterable[str]) -> list[str]:
    """The consumer groups of the pipeline's stages: ``<prefix>-*``, sorted."""
    return sorted(g for g in groups if g.startswith(f"{topic_prefix}-"))


def subscriptions(member_metadata: Iterable[bytes]) -> set[str]:
    """Topics named in classic consumer-protocol member metadata; undecodable entries
    (another protocol type) are skipped, since committed offsets still cover their group."""
    topics: set[str] = set()
    for raw in member_metadata:
        try:
            topics.update(ConsumerProtocolMemberMetadata.decode(raw).subscription)
        except Exception:  # any parse failure of foreign metadata means "unknown", not an error
            continue
    return topics


class LagReader:
    """Kafka clients kept open between measurements (an admin and an unassigned consumer,
    which only asks for offsets and never joins a group)."""

    def __init__(self, bootstrap: str, client_kwargs: dict[str, Any] | None = None) -> None:
        self.bootstrap = bootstrap
        self.client_kwargs = client_kwargs or {}
        """Security options of both clients (``streams.connection.client_kwargs``)."""
        self.admin: AIOKafkaAdminClient | None = None
        self.consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        """Connect (no-op if connected). Raises ``KafkaError`` and stays closed, so a later
        ``start`` tries again with fresh clients (a stopped aiokafka client cannot restart)."""
        if self.admin is not None:
            return
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="mmstream-lagmon", **self.client_kwargs)
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, client_id="mmstream-lagmon",
                                    enable_auto_commit=False, **self.client_kwargs)
        try:
            await admin.start()
            await consumer.start()
        except BaseException:
            await consumer.stop()
            await admin.close()
            raise
        self.admin, self.consumer = admin, consumer

    async def close(self) -> None:
        admin, consumer = self.admin, self.consumer
        self.admin = self.consumer = None
        if consumer is not None:
            await consumer.stop()
        if admin is not None:
            await admin.close()

    async def __aenter__(self) -> "LagReader":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def measure(self, topic_prefix: str) -> list[LagRow]:
        """Lag rows of every ``<prefix>-*`` group on the ``<prefix>.*`` topics it consumes.

        Raises ``aiokafka.errors.KafkaError`` when the broker cannot answer, and
        ``RuntimeError`` if the reader is not started.
        """
        if self.admin is None or self.consumer is None:
            raise RuntimeError("LagReader.measure before start")
        listed = await self.admin.list_consumer_groups()
        groups = pipeline_groups(topic_prefix, (entry[0] for entry in listed))
        if not groups:
            return []
        members = await self._member_metadata(groups)
        committed: dict[str, dict[TopicPartition, int]] = {}
        for group in groups:
            offsets = await self.admin.list_consumer_group_offsets(group)
            committed[group] = {tp: om.offset for tp, om in offsets.items()}
        wanted = {g: consumed_topics(topic_prefix, committed[g], subscriptions(members.get(g, ())))
                  for g in groups}
        partitions = await self._partitions(set().union(*wanted.values()))
        tps = [tp for ps in partitions.values() for tp in ps]
        if not tps:
            return []
        # One request each for all partitions: the same end offset is compared with every
        # group that reads the partition, at nearly the same instant.
        beginnings = await self.consumer.beginning_offsets(tps)
        ends = await self.consumer.end_offsets(tps)
        rows: list[LagRow] = []
        for group in groups:
            mine = [tp for t in sorted(wanted[group]) for tp in partitions.get(t, ())]
            rows.extend(lag_rows(group, committed[group], beginnings, {tp: ends[tp] for tp in mine}))
        return rows

    async def measure_groups(self, wanted: Mapping[str, Iterable[str]]) -> list[LagRow]:
        """Lag rows of each named group on the topics named for it, whether or not the group
        exists yet: a pool scaled to zero before it ever committed has no group on the broker,
        and its first record must still show as lag (the scaler wakes the pool on it).
        Topics that do not exist are skipped. Raises like ``measure``."""
        if self.admin is None or self.consumer is None:
            raise RuntimeError("LagReader.measure_groups before start")
        wanted = {g: set(ts) for g, ts in wanted.items()}
        partitions = await self._partitions(set().union(*wanted.values()) if wanted else set())
        tps = [tp for ps in partitions.values() for tp in ps]
        if not tps:
            return []
        beginnings = await self.consumer.beginning_offsets(tps)
        ends = await self.consumer.end_offsets(tps)
        rows: list[LagRow] = []
        for group, topics in wanted.items():
            offsets = await self.admin.list_consumer_group_offsets(group)
            committed = {tp: om.offset for tp, om in offsets.items() if om.offset >= 0}
            mine = [tp for t in sorted(topics) for tp in partitions.get(t, ())]
            rows.extend(lag_rows(group, committed, beginnings, {tp: ends[tp] for tp in mine}))
        return rows

    async def _member_metadata(self, groups: list[str]) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for group in groups:
            # One group per request: aiokafka 0.14 sends DescribeGroups v3 but decodes the
            # answer with the v2 schema, which lacks each group's trailing
            # authorized_operations; with one group the extra bytes are ignored, with two
            # the decoder runs off the end and the connection is dropped.
            for response in await self.admin.describe_consumer_groups([group]):
                for g in response.groups:
                    group_id, protocol_type, members = _group_fields(g)
                    if protocol_type == "consumer":
                        out[group_id] = [m[3] for m in members]  # (id, client_id, host, metadata, assignment)
        return out

    async def _partitions(self, topics: set[str]) -> dict[str, list[TopicPartition]]:
        """Partitions of each of ``topics`` that exists now (a deleted topic's old commits
        are skipped). Asks for all topics' metadata rather than naming them, because a
        metadata request naming a missing topic may auto-create it on some clusters."""
        out = {}
        for t in await self.admin.describe_topics():
            if t["topic"] in topics and not t["error_code"] and t["partitions"]:
                out[t["topic"]] = [TopicPartition(t["topic"], p["partition"])
                                   for p in sorted(t["partitions"], key=lambda p: p["partition"])]
        return out


def _group_fields(g: Any) -> tuple[str, str, list[Any]]:
    # DescribeGroups v0-v2 entries: (error_code, group, state, protocol_type, protocol, members)
    return g[1], g[3], list(g[5])


async def measure_lag(bootstrap: str, topic_prefix: str, client_kwargs: dict[str, Any] | None = None) -> list[LagRow]:
    """Lag of every ``<prefix>-*`` consumer group on every ``<prefix>.*`` topic it consumes,
    one row per (group, topic, partition), sorted by group, topic, partition.

    Opens and closes its own connections; use ``LagReader`` to measure repeatedly. Raises
    ``aiokafka.errors.KafkaError`` when the broker cannot be reached or cannot answer.
    """
    async with LagReader(bootstrap, client_kwargs) as reader:
        return await reader.measure(topic_prefix)


class LagMonitor:
    """Sets ``metrics``' consumer-lag gauges from the broker every ``interval_s`` seconds.

    A failed refresh keeps the previous values (stale lag is a better autoscaling signal
    than none) and counts as ``mmstream_requests_total{stage="lagmon",outcome="error"}``;
    a good one as ``outcome="ok"``.
    """

    def __init__(self, bootstrap: str, topic_prefix: str, metrics: Metrics,
                 interval_s: float = DEFAULT_INTERVAL_S, client_kwargs: dict[str, Any] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.reader = LagReader(bootstrap, client_kwargs)
        self.topic_prefix = topic_prefix
        self.metrics = metrics
        self.interval_s = interval_s
        self.last: list[LagRow] = []
        self.last_ok_at: float | None = None
        """Monotonic time of the last successful refresh."""

    def fresh(self, now: float | None = None) -> bool:
        """Whether the last successful read is recent (three intervals): the readiness of
        the lag monitor. Past that the lag gauges are stale and alerts on them go quiet."""
        now = time.monotonic() if now is None else now
        return self.last_ok_at is not None and now - self.last_ok_at <= 3 * self.interval_s

    async def refresh(self) -> list[LagRow]:
        """Measure once and publish; returns the rows. Raises ``KafkaError`` on failure."""
        await self.reader.start()
        rows = await self.reader.measure(self.topic_prefix)
        self.metrics.set_consumer_lag(rows)
        self.last = rows
        self.last_ok_at = time.monotonic()
        return rows

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh until ``stop`` is set, on a fixed cadence measured with a monotonic clock."""
        try:
            next_at = time.monotonic()
            while not stop.is_set():
                try:
                    await self.refresh()
                    self.metrics.request_done(STAGE, "ok")
                except (KafkaError, OSError, asyncio.TimeoutError) as exc:
                    log.warning("lagmon: refresh failed, keeping the last values: %r", exc)
                    self.metrics.request_done(STAGE, "error", "internal")
                    await self.reader.close()  # reconnect from scratch next time
                next_at = max(next_at + self.interval_s, time.monotonic())
                try:
                    await asyncio.wait_for(stop.wait(), next_at - time.monotonic())
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.reader.close()


def run_lag_monitor(settings: Settings, port: int, interval_s: float = DEFAULT_INTERVAL_S,
                    on_bound: Callable[[int], None] | None = None) -> None:
    """Run the lag monitor in this process until SIGTERM or SIGINT: serve metrics on
    ``port`` (0 picks one; ``on_bound`` is told which) and refresh them every ``interval_s``."""
    health = process_health()
    metrics = Metrics(health=health)
    monitor = LagMonitor(settings.kafka.bootstrap, settings.kafka.topic_prefix, metrics, interval_s,
                         client_kwargs(settings))
    health.stage = STAGE
    health.require(STAGE, ready=monitor.fresh)
    bound = serve(port, metrics.registry, settings.metrics.bind, health)
    if on_bound is not None:
        on_bound(bound)
    log.info("lagmon: metrics on :%d, prefix %r, every %.1fs", bound, settings.kafka.topic_prefix, interval_s)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await monitor.run(stop)

    asyncio.run(main())
