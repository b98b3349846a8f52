"""A stage's own Kafka I/O: records in batches, outputs sent without waiting for them one by
one, and offsets committed only below the lowest record whose outputs are not yet with the
broker.

The contract a stage relies on:

- ``poll`` returns records in offset order per partition and starts tracking each one.
- ``deliver(outs, inputs)`` sends the outputs and returns at once; when the broker has every
  one of them, the inputs are finished. ``finish(inputs)`` finishes inputs that produce
  nothing. A record is finished at most once; order does not matter.
- The committed offset of a partition never passes a record that is not finished (see
  ``offsets.OffsetTracker``), so a crash repeats work and never loses it. Commits happen
  every ``commit_interval_s`` and when partitions are revoked.
- A retriable send failure is retried with backoff until it succeeds (its inputs stay
  unfinished meanwhile, so the commit point waits); a non-retriable one (record too large
  for the topic, topic gone) is handed to the stage's ``on_failed_output``, which returns a
  replacement record (an error event, a dead letter) or None.
- Nothing is sent while this replica may have lost its partitions (``fence.py``: a stall
  past the session timeout). Outputs held then are sent once ownership is confirmed, or
  dropped with their inputs left unfinished when the partitions are revoked: the next owner
  repeats that work, and this replica never sends for partitions another one owns.
- On a revoke, outputs in flight get ``revoke_drain_s`` to reach the broker (so the next
  owner, reading the broker when it takes over, sees them); what is still unsent then is
  dropped, its inputs unfinished.

Why the stages do not read through Faust agents: on this project's 2-core reference box a
Faust agent relaying records cost 200 µs of CPU per record (645 µs when each send is
awaited), against 17 µs for ``getmany`` and batched sends through aiokafka, and added about
3 ms per hop at the median; and Faust's acking could commit past an unfinished record when
work finishes out of order. Faust still hosts every worker (app, worker lifecycle, signals,
timers); its own consumer is switched off for these stages (``BootStrategy``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from streams.runtime.produce import Out
from streams.runtime.fence import FencedError, Lease, ProducerGate, watch_coordinator
from streams.runtime.fetch_order import FetchOrder, install as install_fetch_order
from streams.runtime.clients import close_quietly, start_when_reachable
from streams.runtime.offsets import OffsetTracker

log = logging.getLogger(__name__)

RETRY_BASE_S = 0.05
RETRY_MAX_S = 1.0
"""Backoff of an output the producer gave up on (a retriable error), doubled per attempt up to
this, times 0.5-1.5: bounded, so an output waits at most about a second longer than the
broker it waits for (a 5 s cap measured up to 7 s of the broker scenario's recovery)."""
# (record that could not be sent, its error) -> what to send instead, or None
FailedOutput = Callable[[Out, BaseException], Out | None]


@dataclass(frozen=True, slots=True)
class IOSettings:
    """How one stage talks to Kafka (built from ``schemas.settings.Settings``)."""

    bootstrap: str
    group_id: str
    client_kwargs: dict[str, Any]
    """Security and client options shared by every client (``security_protocol``, SASL, TLS)."""
    max_records: int = 500
    """Most records one ``poll`` returns."""
    fetch_max_wait_ms: int = 500
    """How long the broker holds an idle fetch open (records arriving answer it at once)."""
    max_message_bytes: int = 8 * 1024 * 1024
    fetch_max_bytes: int = 1024 * 1024
    """Most bytes one fetch response carries (at least one batch)."""
    fetch_small_first: bool = True
    """Fetch requests name the partitions of small records first (``streams.runtime.fetch_order``)."""
    linger_ms: int = 0
    """How long the producer waits to fill a batch: trades a little latency for fewer requests."""
    commit_interval_s: float = 0.2
    commit_timeout_s: float = 5.0
    """Longest one commit may take. aiokafka retries a retriable commit error for ever (a topic
    deleted under the stage answers UNKNOWN_TOPIC_OR_PARTITION to every try; no coordinator while
    the broker is away): past this the commit is given up, the next one (or the next owner)
    starts from the last committed point, and the stage goes on stopping or rebalancing."""
    session_timeout_ms: int = 30_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    revoke_drain_s: float = 5.0
    """How long a revoke waits for outputs in flight before dropping the rest."""

    @property
    def rebalance_timeout_ms(self) -> int:
        """How long the coordinator waits for this member to rejoin once a rebalance started:
        long enough for the revoke to settle (``revoke_drain_s``, then its commit, at most
        ``commit_timeout_s``) on top of a session, so a short session never makes a member that
        is draining its outputs miss the rebalance. A dead member does not hold a rebalance this
        long: its session ends it first."""
        return self.session_timeout_ms + int((self.revoke_drain_s + self.commit_timeout_s) * 1000)

    @property
    def fence_margin_s(self) -> float:
        """How long before the broker could drop this member the stage stops sending."""
        return self.session_timeout_ms / 3000.0
    metadata_max_age_ms: int = 5_000
    """How often cluster metadata is refreshed: a topic created a moment before the stage
    joined, or a new topic matching a pattern subscription, is seen within it."""


class StageIO:
    """One consumer (in the stage's group) and one idempotent producer for a stage.

    It subscribes to ``topics``, or, given a ``pattern`` (a regular expression matched
    against whole topic names), to every topic matching it now or created later."""

    def __init__(self, settings: IOSettings, topics: Sequence[str], pattern: str | None = None,
                 on_assigned: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
                 on_revoked: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
                 on_failed_output: FailedOutput | None = None, lane_rank: Callable[[str], int] | None = None) -> None:
        self.settings = settings
        self.topics = list(topics)
        self.pattern = pattern
        self.tracker = OffsetTracker()
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        self.on_failed_output = on_failed_output
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self._committed: dict[TopicPartition, int] = {}
        self._taking_over: set[TopicPartition] = set()
        """Partitions paused while the stage takes them over: ``resume`` leaves them paused."""
        self._takeovers: set[asyncio.Task] = set()
        """Take-overs running (``on_assigned``), outside the rebalance callback: see ``_Listener``."""
        self._commit_task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()
        self._random = random.Random()
        self.lease = Lease(settings.session_timeout_ms / 1000.0, settings.fence_margin_s)
        self.gate = ProducerGate(self.lease, settings.group_id)
        self.fetch_order = FetchOrder(rank=lane_rank) if settings.fetch_small_first else None
        """``lane_rank``: a topic's lane, lower fetched first (rt 0, bulk 1)."""
        self.epoch = 0
        """Assignments so far: output held across a revoke is never sent again."""
        self.dropped = 0
        """Outputs dropped because the partitions they were for were lost meanwhile."""
        self.handed: set[tuple[str, int, int]] = set()
        """The records of the batch being handled that the stage has taken care of (delivered,
        finished, joined or ``hold``); see ``RecordStage``: if handling raises, only the others
        are handled again, one at a time."""

    # -- life ------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self.producer = await self._new_producer()
        try:
            self.consumer = await self._new_consumer()
        except BaseException:  # the broker never answered, or the start was cancelled: no producer left open
            producer, self.producer = self.producer, None
            await close_quietly(producer)
            raise
        watch_coordinator(self.consumer, self.lease)
        if self.fetch_order is not None:
            install_fetch_order(self.consumer, self.fetch_order)
        if self.pattern is not None:
            self.consumer.subscribe(pattern=self.pattern, listener=_Listener(self))
        else:
            self.consumer.subscribe(self.topics, listener=_Listener(self))
        self._commit_task = asyncio.create_task(self._commit_loop(), name=f"{s.group_id}-commits")

    async def _new_consumer(self) -> AIOKafkaConsumer:
        s = self.settings
        return await start_when_reachable(lambda: AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap, group_id=s.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=s.fetch_max_wait_ms,
            max_partition_fetch_bytes=s.max_message_bytes, fetch_max_bytes=s.fetch_max_bytes,
            session_timeout_ms=s.session_timeout_ms, heartbeat_interval_ms=s.heartbeat_interval_ms,
            rebalance_timeout_ms=s.rebalance_timeout_ms,
            max_poll_interval_ms=s.max_poll_interval_ms, metadata_max_age_ms=s.metadata_max_age_ms,
            client_id=f"{s.group_id}-consumer", **s.client_kwargs), f"{s.group_id} consumer")

    async def _new_producer(self) -> AIOKafkaProducer:
        s = self.settings
        producer = await start_when_reachable(lambda: AIOKafkaProducer(
            bootstrap_servers=s.bootstrap, acks="all", enable_idempotence=True, linger_ms=s.linger_ms,
            max_request_size=s.max_message_bytes, client_id=f"{s.group_id}-producer", **s.client_kwargs),
            f"{s.group_id} producer")
        self.gate.install(producer)
        return producer

    async def stop(self, drain_s: float = 5.0) -> None:
        """Wait up to ``drain_s`` for outputs in flight, commit what is finished, close."""
        await self.stop_taking_over()
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=drain_s)
        if self._commit_task:
            self._commit_task.cancel()
        try:
            await self.commit()
        except Exception as exc:  # stopping anyway: the next owner repeats the rest
            log.warning("%s: last commit failed: %r", self.settings.group_id, exc)
        try:
            if self.consumer:
                await self.consumer.stop()
        finally:  # the producer is stopped even when the consumer's stop failed
            if self.producer:
                await self.producer.stop()

    # -- records in ------------------------------------------------------------------------

    async def poll(self, timeout_ms: int, max_records: int | None = None) -> list[ConsumerRecord]:
        """Up to ``max_records`` records (default and cap: the settings'; at least one) in
        offset order per partition, each now tracked."""
        assert self.consumer is not None
        limit = self.settings.max_records if max_records is None else max(1, min(max_records, self.settings.max_records))
        batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=limit)
        out: list[ConsumerRecord] = []
        for tp, records in batch.items():
            for r in records:
                self.tracker.take(tp, r.offset)
            out.extend(records)
            if self.fetch_order is not None and records:
                self.fetch_order.observe(tp, max(r.serialized_value_size for r in records))
        return out

    def finish(self, inputs: Iterable[ConsumerRecord]) -> None:
        """Inputs that are done and produced nothing (or whose outputs are already acked)."""
        for r in inputs:
            self.handed.add((r.topic, r.partition, r.offset))
            self.tracker.finish(TopicPartition(r.topic, r.partition), r.offset)

    def hold(self, inputs: Iterable[ConsumerRecord]) -> None:
        """The stage keeps these records to finish later (queued work, a request's open state):
        they count as taken care of in the batch being handled."""
        self.handed.update((r.topic, r.partition, r.offset) for r in inputs)

    def backlog(self, topic: str) -> int:
        """Records of ``topic`` on this consumer's partitions not yet returned by ``poll``:
        known locally from the last fetch (no broker round trip); none before ``start``."""
        if self.consumer is None:
            return 0
        total = 0
        for tp in self.consumer.assignment():
            if tp.topic != topic:
                continue
            high = self.consumer.highwater(tp)
            pos = self.consumer._subscription.subscription.assignment.state_value(tp)  # noqa: SLF001
            if high is not None and pos is not None and pos.has_valid_position:
                total += max(0, high - pos.position)
        return total

    def pause(self, topic: str) -> None:
        if self.consumer is None:  # not started (or a stage without intake): nothing to pause
            return
        self.consumer.pause(*[tp for tp in self.consumer.assignment() if tp.topic == topic])

    def resume(self, topic: str) -> None:
        """Resume ``topic``'s partitions, except those still being taken over (a stage that
        pauses and resumes for its own flow control must not let their records in early)."""
        if self.consumer is None:
            return
        self.consumer.resume(*[tp for tp in self.consumer.assignment()
                               if tp.topic == topic and tp not in self._taking_over])

    def assignment(self) -> set[TopicPartition]:
        return set(self.consumer.assignment()) if self.consumer else set()

    # -- records out -----------------------------------------------------------------------

    def deliver(self, outs: Sequence[Out], inputs: Iterable[ConsumerRecord] = (),
                epoch: int | None = None) -> asyncio.Task:
        """Send ``outs`` (in order per partition) and, once the broker has all of them,
        finish ``inputs``. Returns at once; the task it returns ends when that happened, with
        True, or with False when the partitions were revoked first (the outputs held then
        were dropped, the inputs left unfinished for their next owner). ``epoch``: the
        assignment the inputs were read in (default: now); outputs of an older one are
        dropped, never sent."""
        inputs = list(inputs)
        self.handed.update((r.topic, r.partition, r.offset) for r in inputs)
        task = asyncio.create_task(self._deliver(list(outs), inputs, self.epoch if epoch is None else epoch))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def _deliver(self, outs: list[Out], inputs: list[ConsumerRecord], epoch: int) -> bool:
        pending = outs
        attempt = 0
        while pending:
            if epoch != self.epoch:  # the partitions were revoked meanwhile: their next owner redoes this
                self.dropped += len(pending)
                return False
            failed: list[Out] = []
            futures = []
            for o in pending:
                try:
                    futures.append((o, await self._send(o)))
                except Exception as exc:  # raised before the record was queued
                    failed.append(self._handle_failure(o, exc))
            for o, fut in futures:
                try:
                    await fut
                except Exception as exc:
                    failed.append(self._handle_failure(o, exc))
            pending = [o for o in failed if o is not None]
            if pending and epoch != self.epoch:
                continue  # dropped at the top of the loop
            if pending:
                attempt += 1
                delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** min(attempt, 8)) * (0.5 + self._random.random())
                log.warning("%s: %d outputs not delivered; retry %d in %.1fs", self.settings.group_id,
                            len(pending), attempt, delay)
                await asyncio.sleep(delay)
        if epoch != self.epoch:  # revoked; the same offsets may be another assignment's now
            return False
        self.finish(inputs)
        return True

    async def _send(self, o: Out) -> asyncio.Future:
        assert self.producer is not None
        return await self.producer.send(o.topic, o.value, key=o.key, partition=o.partition,
                                        headers=o.headers or None)

    def _handle_failure(self, o: Out, exc: BaseException) -> Out | None:
        """The record to try again (itself when the error is retriable, a replacement from
        the stage otherwise), or None to give up on it."""
        if isinstance(exc, FencedError):
            return o  # sent again only if its partitions were not revoked meanwhile (see _deliver)
        if isinstance(exc, KafkaError) and exc.retriable:
            return o
        log.error("%s: output to %s failed for good: %r", self.settings.group_id, o.topic, exc)
        if self.on_failed_output is None:
            return None
        try:
            return self.on_failed_output(o, exc)
        except Exception:
            log.exception("%s: replacing a failed output failed", self.settings.group_id)
            return None

    # -- commits ---------------------------------------------------------------------------

    async def commit(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """Commit the commit point of ``tps`` (default: every assigned partition) where it moved,
        except on topics the cluster no longer has (deleted: nothing is left to repeat), within
        ``commit_timeout_s`` (``asyncio.TimeoutError`` past it: nothing was lost, the work since
        the last commit is repeated by whoever reads the partitions next)."""
        if self.consumer is None:
            return
        moved = {}
        for tp in (self.consumer.assignment() if tps is None else tps):
            point = self.tracker.commit_point(tp)
            if point is not None and self._committed.get(tp) != point:
                moved[tp] = point
        if not moved:  # an idle stage's commit every interval: nothing to send, nothing to look up
            return
        known = self._cluster_topics()
        offsets = {tp: OffsetAndMetadata(point, "") for tp, point in moved.items() if known is None or tp.topic in known}
        if offsets:
            await asyncio.wait_for(self.consumer.commit(offsets), self.settings.commit_timeout_s)
            self._committed.update({tp: om.offset for tp, om in offsets.items()})

    def _cluster_topics(self) -> set[str] | None:
        """The topics in the client's last metadata (refreshed every ``metadata_max_age_ms`` and on
        errors; a partition is assigned only after one), or None for a client without any. Empty
        when every topic the stage reads is gone (a broker that came back without them): then
        nothing is committed. A topic the metadata left out for an error of its own is skipped
        for that commit only, and only costs repeated work if the stage stops before the next."""
        cluster = getattr(getattr(self.consumer, "_client", None), "cluster", None)
        return set(cluster.topics()) if cluster is not None else None

    def start_take_over(self, tps: set[TopicPartition]) -> None:
        """Pause ``tps`` and take them over (``on_assigned``) in a task of their own; they are
        resumed when it ends. Nothing of them reaches the stage before: a stage that answers
        clients first learns what was answered (recovery.py)."""
        assert self.consumer is not None and self.on_assigned is not None
        self.consumer.pause(*tps)
        self._taking_over |= tps
        task = asyncio.create_task(self._take_over(tps), name=f"{self.settings.group_id}-take-over")
        self._takeovers.add(task)
        task.add_done_callback(self._takeovers.discard)

    async def _take_over(self, tps: set[TopicPartition]) -> None:
        consumer = self.consumer
        assert consumer is not None and self.on_assigned is not None
        try:
            await self.on_assigned(tps)
        except Exception:  # the stage's own take-over catches what it expects; a bug costs the recovery only
            log.exception("%s: taking over %d partitions failed", self.settings.group_id, len(tps))
        finally:
            self._taking_over -= tps
            consumer.resume(*[tp for tp in tps if tp in consumer.assignment()])

    async def stop_taking_over(self) -> None:
        """Cancel the take-overs running (their partitions are going) and wait for them to end."""
        tasks = list(self._takeovers)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def settle_before_revoke(self) -> None:
        """Partitions are about to go: outputs in flight get ``revoke_drain_s`` to reach the
        broker while ownership holds; the rest is dropped (its inputs stay unfinished), and
        outputs of the partitions still being delivered are never sent again (``epoch``)."""
        if self._inflight and self.lease.held():
            await asyncio.wait(list(self._inflight), timeout=self.settings.revoke_drain_s)
        self.epoch += 1
        if self.gate.discard():
            # A dropped batch had its sequence number spent: a fresh producer starts over.
            old = self.producer
            self.producer = await self._new_producer()
            asyncio.create_task(close_quietly(old), name=f"{self.settings.group_id}-old-producer")
        if self.gate.discarded:
            log.warning("%s: %d outputs dropped so far: held while ownership was in doubt, then lost",
                        self.settings.group_id, self.gate.discarded)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.commit_interval_s)
            try:
                await self.commit()
            except Exception as exc:  # a rebalance in progress, a fenced generation: next time
                log.info("%s: commit skipped: %r", self.settings.group_id, exc)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, io: StageIO) -> None:
        self.io = io

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        revoked = set(revoked)
        await self.io.stop_taking_over()  # eager rebalancing: every partition goes, those being taken over too
        await self.io.settle_before_revoke()
        try:
            await self.io.commit(revoked)
        except Exception as exc:
            log.info("%s: commit on revoke failed: %r", self.io.settings.group_id, exc)
        self.io.tracker.revoke(revoked)
        for tp in revoked:
            self.io._committed.pop(tp, None)  # noqa: SLF001
        if self.io.on_revoked and revoked:
            await self.io.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """The take-over runs after this returns, its partitions paused meanwhile. Not in here:
        the client sends no heartbeat while this callback runs, and a take-over reads every new
        partition's recent history (recovery.py), which grows with the partitions (a tenant's
        topics each): past the session timeout the broker evicts the member, the group
        rebalances, the take-over starts again and outlasts the session again, and the stage
        never serves again (measured: 16 tenants' topics, a 6.6 s take-over, a 6 s session)."""
        assigned = set(assigned)
        self.io.tracker.assign(assigned)
        if self.io.on_assigned and assigned:
            self.io.start_take_over(assigned)
