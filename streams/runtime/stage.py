"""The shape every stage shares: a service on the stage's Faust app that owns a ``StageIO``,
polls it in a loop and hands each batch of records to the stage.

A stage subclasses ``RecordStage`` and implements ``handle(records)``; it finishes each
record exactly once, through ``io.deliver(outs, inputs)`` (finished when its outputs are
with the broker) or ``io.finish(inputs)``. ``handle`` must not raise for one bad record:
what a record can do wrong ends as an error event or a dead letter. An exception that
escapes anyway is logged, and the records of the batch the stage had not yet taken care of
(delivered, finished, joined, or kept with ``io.hold``) are handled again one at a time:
the one that raises alone is dead-lettered alone, so one bad record costs itself, never its
neighbours (up to a poll of every tenant's records) nor the stage.

Loops that survive their own errors: every long-running task of a stage is started with
``supervise(name, factory)``; one that raises is logged, counted
(``mmstream_task_restarts_total``) and started again after a backoff, so a bug in a sweep or
a step loop costs one turn, never the stage's deadlines or answers.

Bounded intake: ``poll_budget()`` caps how many records one poll may take (a stage that holds
jobs in memory returns what room it has left), so what a stage holds never passes its bound
by a poll's worth; at 0 every input topic is paused (the consumer keeps polling, so it stays
in its group) until the stage has room again, and the rt-first gate applies from there.

rt before bulk: the stage's rt topics are polled together with its bulk topics, and
``handle`` sees rt records first; while the rt backlog (records not yet polled, known
locally) is over ``rt_backlog_records``, the bulk topics are paused, so bulk records wait
in the broker instead of in this process.

A stage may subscribe by ``pattern`` instead (the router in authenticated mode reads every
tenant's ingress topic, created while it runs): then ``lane_of_topic`` says which lane a
topic belongs to, and the rt/bulk rules apply to whatever topics it is assigned.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import traceback
from typing import Any, Awaitable, Callable, Sequence

import faust
import mode
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.settings import Settings
from streams.observe.health import process_health
from streams.runtime.produce import Out, dead_letter
from streams.policies.pacing import LargeRecordPacing
from streams.runtime.io import IOSettings, StageIO
from streams.connection import client_kwargs
from schemas.topics import TopicNames

__all__ = ["RecordStage", "io_settings"]

log = logging.getLogger(__name__)

RESTART_BASE_S = 0.1
RESTART_MAX_S = 5.0
RESTART_RESET_S = 30.0
"""A task that ran this long before failing restarts from the shortest backoff again."""


def io_settings(settings: Settings, group_id: str) -> IOSettings:
    k = settings.kafka
    return IOSettings(bootstrap=k.bootstrap, group_id=group_id, client_kwargs=client_kwargs(settings),
                      max_message_bytes=k.max_message_bytes, fetch_max_bytes=k.fetch_max_bytes,
                      fetch_max_wait_ms=k.fetch_max_wait_ms, fetch_small_first=k.fetch_small_first,
                      linger_ms=k.linger_ms, commit_interval_s=k.commit_interval_ms / 1000.0,
                      session_timeout_ms=k.session_timeout_ms,
                      heartbeat_interval_ms=min(k.heartbeat_interval_ms, k.session_timeout_ms // 3))


class RecordStage(mode.Service):
    """A stage's record loop on its Faust app. Subclasses set ``stage`` and implement ``handle``."""

    stage = "stage"
    poll_timeout_ms = 100

    def __init__(self, app: faust.App, settings: Settings, rt_topics: Sequence[str], bulk_topics: Sequence[str],
                 rt_backlog_records: int | None = None, pattern: str | None = None, group_id: str | None = None,
                 intake: bool = True, **kwargs: Any) -> None:
        self.app = app
        self.settings = settings
        self.names = TopicNames(settings.kafka.topic_prefix)
        self.rt_topics = list(rt_topics)
        self.bulk_topics = list(bulk_topics)
        self.pattern = pattern
        self.intake = intake
        """Whether the stage reads its topics; off, it joins no group and polls nothing (a stage
        fed only in process, like a router's own encoder that takes only its hand-overs)."""
        self.rt_backlog_records = (settings.admission.rt_backlog_records if rt_backlog_records is None
                                   else rt_backlog_records)
        self.bulk_paused = False
        self.intake_full = False
        """Every input topic is paused: the stage has no room (``poll_budget`` 0)."""
        self.pacing: LargeRecordPacing | None = None
        """Set by a stage whose input topics are per tenant (the router on an authenticating
        broker): how fast it reads one tenant's large records (``streams.policies.pacing``)."""
        self.paced: dict[str, float] = {}
        """Tenant -> when its topics, held by ``pacing``, are taken again (monotonic s)."""
        self.turn_records: int | None = None
        """Set by a stage whose input topics are per tenant: the most records of one tenant it
        handles per turn of its loop. The rest wait in ``deferred``, that tenant's topics paused,
        and go in the next turns beside what the others sent meanwhile: a poll that brings
        hundreds of one tenant's records (its backlog, taken again after a hold or a restart)
        does not hold the others' records behind all of them. A tenant held by a pacing gets
        no turn until its hold ends."""
        self.deferred: dict[str, collections.deque[ConsumerRecord]] = {}
        self._deferred_epoch = 0
        self.health = process_health()
        self.restarts: dict[str, int] = {}
        """Task name -> times it raised and was started again."""
        io = io_settings(settings, group_id or app.conf.id)  # a co-located stage joins its own pool's group
        if pattern is not None:  # new matching topics are found at the next metadata refresh
            io = dataclasses.replace(io, metadata_max_age_ms=max(1000, int(settings.router.topic_cache_s * 1000)))
        self.io = StageIO(io, [*self.rt_topics, *self.bulk_topics], pattern=pattern,
                          on_assigned=self.on_assigned, on_revoked=self.on_revoked,
                          on_failed_output=self.on_failed_output,
                          lane_rank=lambda topic: int(self.lane_of_topic(topic) == "bulk"))
        super().__init__(loop=app.loop, **kwargs)

    def install(self) -> "RecordStage":
        """Start with the app: the app's worker starts and stops this service."""
        self.app.service(self)
        return self

    # -- what stages implement -------------------------------------------------------------

    async def handle(self, records: list[ConsumerRecord]) -> None:
        raise NotImplementedError

    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        """Partitions this replica now owns (restore state here)."""

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        """Partitions taken away: drop queued work of theirs (the next owner repeats it)."""

    def on_failed_output(self, out: Out, exc: BaseException) -> Out | None:
        """A record the broker refuses for good: dead-letter its metadata by default."""
        if out.topic == self.names.dlq:
            return None
        return dead_letter(self.names.dlq, out.key, b"", f"internal: could not send to {out.topic}: {exc!r}",
                           source=self.stage, max_bytes=self.settings.kafka.max_message_bytes)

    def dlq(self, r: ConsumerRecord, reason: str) -> Out:
        """The dead letter of input record ``r``: ``reason`` starts with a stable code."""
        return dead_letter(self.names.dlq, r.key, r.value, reason, headers=r.headers, source=_where(r),
                           max_bytes=self.settings.kafka.max_message_bytes, keep_payload=self.settings.dlq.keep_payload)

    def lane_of_topic(self, topic: str) -> str:
        """``rt`` or ``bulk``: the lane of one of this stage's input topics."""
        return "bulk" if topic in self.bulk_topics else "rt"

    def lane_of(self, record: ConsumerRecord) -> str:
        return self.lane_of_topic(record.topic)

    def topics_of_lane(self, lane: str) -> list[str]:
        """This stage's input topics of ``lane`` (with a pattern: those assigned now)."""
        if self.pattern is None:
            return self.bulk_topics if lane == "bulk" else self.rt_topics
        return sorted({tp.topic for tp in self.io.assignment() if self.lane_of_topic(tp.topic) == lane})

    def backlog_rt(self) -> int:
        return sum(self.io.backlog(t) for t in self.topics_of_lane("rt"))

    def bulk_gate(self, hold: bool) -> None:
        """Pause (``hold``) or resume the bulk topics; idempotent."""
        if hold:  # paused again every time: a rebalance hands partitions back unpaused
            for t in self.topics_of_lane("bulk"):
                self.io.pause(t)
            if not self.bulk_paused:
                self.bulk_paused = True
                log.info("%s: holding bulk (rt backlog %d)", self.stage, self.backlog_rt())
        elif not hold and self.bulk_paused:
            for t in self.topics_of_lane("bulk"):
                if not self._held(self.tenant_of_topic(t)):
                    self.io.resume(t)
            self.bulk_paused = False
            log.info("%s: taking bulk again", self.stage)

    # -- the loop --------------------------------------------------------------------------

    async def on_start(self) -> None:
        if self.intake:
            await self.io.start()

    async def on_started(self) -> None:
        if self.intake:
            self.supervise("poll", self._poll_forever)

    def supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run ``factory()`` until the stage stops, starting it again whenever it raises."""
        self.add_future(self._supervised(name, factory))

    async def _supervised(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        failures = 0
        while not self.should_stop:
            started = time.monotonic()
            try:
                await factory()
            except asyncio.CancelledError:
                raise
            except Exception:
                if time.monotonic() - started >= RESTART_RESET_S:
                    failures = 0
                failures += 1
                self.restarts[name] = self.restarts.get(name, 0) + 1
                metrics = getattr(self, "metrics", None)
                if metrics is not None and hasattr(metrics, "task_restart"):
                    metrics.task_restart(self.stage, name)
                delay = min(RESTART_MAX_S, RESTART_BASE_S * 2 ** min(failures - 1, 8))
                log.exception("%s: task %s failed (%d in a row); starting it again in %.1fs",
                              self.stage, name, failures, delay)
                await asyncio.sleep(delay)
                continue
            if not self.should_stop:  # a loop that returned on its own: a bug, but keep serving
                log.error("%s: task %s returned; starting it again", self.stage, name)
                await asyncio.sleep(RESTART_BASE_S)

    async def on_stop(self) -> None:
        await self.io.stop()

    def should_take_bulk(self) -> bool:
        """Whether to fetch bulk now: by default while the rt backlog is small."""
        return self.backlog_rt() <= self.rt_backlog_records

    def poll_budget(self) -> int | None:
        """Most records the next poll may take (None: the I/O's ``max_records``; 0: none, the
        input topics are paused until it is more)."""
        return None

    def intake_gate(self, full: bool) -> None:
        """Pause every input topic while the stage is ``full``; resume them once it is not."""
        topics = (*self.topics_of_lane("rt"), *self.topics_of_lane("bulk"))
        if full:  # paused again every time: a rebalance hands partitions back unpaused
            for t in topics:
                self.io.pause(t)
            self.intake_full = True
        elif self.intake_full:
            for t in topics:
                if not self._held(self.tenant_of_topic(t)):
                    self.io.resume(t)
            self.intake_full = False
            self.bulk_paused = False  # the rt-first gate applies again from here

    async def _poll_forever(self) -> None:
        while not self.should_stop:
            try:
                budget = self.poll_budget()
                self._release_paced()
                self.intake_gate(budget == 0)
                if not self.intake_full and (self.bulk_topics or self.pattern is not None):
                    self.bulk_gate(not self.should_take_bulk())
                records = await self.io.poll(0 if self._deferred_ready() else self.poll_timeout_ms, budget)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker away, a rebalance: poll again
                log.warning("%s: poll failed: %r", self.stage, exc)
                await asyncio.sleep(0.5)
                continue
            self.health.set_inflight(self.stage, self.io.tracker.total_unfinished())
            if records and self.pacing is not None:
                self._pace(records)
            if self.turn_records is not None:
                records = self._turn(records)
            if not records:
                await self.idle()
                continue
            records.sort(key=lambda r: self.lane_of(r) == "bulk")  # rt first, offset order kept
            await self.handle_isolated(records)

    def tenant_of_topic(self, topic: str) -> str | None:
        """The tenant an input topic belongs to (None: a topic shared by tenants)."""
        return None

    def _tenant_topics(self, tenant: str) -> list[str]:
        return sorted({tp.topic for tp in self.io.assignment() if self.tenant_of_topic(tp.topic) == tenant})

    def _pace(self, records: list[ConsumerRecord]) -> None:
        """Hold the topics of a tenant past its large-record bytes (``pacing``); a failure here
        costs the pacing, never the records."""
        assert self.pacing is not None
        try:
            sizes: dict[str, list[int]] = {}
            for r in records:
                tenant = self.tenant_of_topic(r.topic)
                if tenant is not None:
                    sizes.setdefault(tenant, []).append(r.serialized_value_size)
            now = time.monotonic()
            self.hold_tenants(self.pacing.polled(sizes, now), "large_records", now)
        except Exception:
            log.exception("%s: pacing failed; nothing is held", self.stage)

    def hold_tenants(self, holds: dict[str, float], reason: str, now: float) -> None:
        """Pause the topics of each tenant in ``holds`` until its time (monotonic s), ``reason``
        being which pacing held it; ``_release_paced`` takes them again."""
        for tenant, until in holds.items():
            held = tenant in self.paced
            before = max(self.paced.get(tenant, now), now)
            self.paced[tenant] = max(until, before)
            self.on_paced(tenant, max(0.0, until - before), not held, reason)
            for t in self._tenant_topics(tenant):
                self.io.pause(t)

    def others_served(self, tenant: str, now: float) -> bool:
        """Whether a tenant other than ``tenant`` had records read within the pacing's window
        (a held tenant is taken again once no one else is)."""
        return self.pacing is None or self.pacing.others_seen(tenant, now)

    def on_paced(self, tenant: str, seconds: float, new: bool, reason: str) -> None:
        """A pacing holds ``tenant`` ``seconds`` longer (``new``: it was not held) for
        ``reason``: for metrics."""

    def _release_paced(self) -> None:
        """Take again the topics of tenants whose hold ended or who are alone now (unless a gate
        holds them); hold again those of tenants still held (a rebalance hands partitions back
        unpaused)."""
        if not self.paced:
            return
        now = time.monotonic()
        for tenant, until in list(self.paced.items()):
            if now < until and self.others_served(tenant, now):
                for t in self._tenant_topics(tenant):
                    self.io.pause(t)
                continue
            del self.paced[tenant]
            self._take_again(tenant)

    def _held(self, tenant: str | None) -> bool:
        """Whether ``tenant``'s topics are held by the stage (paced, or records deferred)."""
        return tenant is not None and (tenant in self.paced or tenant in self.deferred)

    def _take_again(self, tenant: str) -> None:
        """Resume ``tenant``'s topics unless it is still held or a gate holds them."""
        if self._held(tenant) or self.intake_full:
            return
        for t in self._tenant_topics(tenant):
            if not (self.bulk_paused and self.lane_of_topic(t) == "bulk"):
                self.io.resume(t)

    def turn_of(self, tenant: str) -> int:
        """The most records of ``tenant`` this turn (at least 1): ``turn_records``."""
        assert self.turn_records is not None
        return self.turn_records

    def _deferred_ready(self) -> bool:
        """Whether a tenant not held by a pacing has records deferred (the next turn has work
        without a poll)."""
        return any(tenant not in self.paced for tenant in self.deferred)

    def _turn(self, records: list[ConsumerRecord]) -> list[ConsumerRecord]:
        """This turn's records: those of shared topics, and up to ``turn_records`` of each
        tenant's, oldest first, the deferred before the new; a tenant with more left has its
        topics paused (so nothing newer of it is read) until they are all taken. A tenant a
        pacing holds gets no turn: what the stage had read of it waits here as the rest waits
        in its topics, until the hold ends (else a released backlog would be routed in full,
        a turn at a time, however soon the pacing held its tenant again)."""
        assert self.turn_records is not None
        if self.io.epoch != self._deferred_epoch:  # revoked since: their next owner reads them again
            self._deferred_epoch = self.io.epoch
            self.deferred.clear()
        paused = set(self.deferred)  # left from the last turn: their topics are paused
        out: list[ConsumerRecord] = []
        for r in records:
            tenant = self.tenant_of_topic(r.topic)
            if tenant is None:
                out.append(r)
            else:
                self.deferred.setdefault(tenant, collections.deque()).append(r)
        for tenant in list(self.deferred):
            queue = self.deferred[tenant]
            if tenant in self.paced:  # its topics were paused by the hold
                continue
            out.extend(queue.popleft() for _ in range(min(self.turn_of(tenant), len(queue))))
            if queue and tenant not in paused:
                for t in self._tenant_topics(tenant):
                    self.io.pause(t)
            elif not queue:
                del self.deferred[tenant]
                if tenant in paused:
                    self._take_again(tenant)
        return out

    async def handle_isolated(self, records: list[ConsumerRecord]) -> None:
        """``handle(records)``; if it raises, each record it had not taken care of is handled
        again alone, and one that raises alone is dead-lettered alone."""
        self.io.handed = set()
        try:
            await self.handle(records)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if len(records) == 1:
                self._park(records[0], exc)
                return
            log.error("%s: a batch of %d records failed (%s); handling its records one at a time", self.stage,
                      len(records), bounded(repr(exc)))
        for r in [r for r in records if (r.topic, r.partition, r.offset) not in self.io.handed]:
            self.io.handed = set()
            try:
                await self.handle([r])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._park(r, exc)

    def _park(self, r: ConsumerRecord, exc: Exception) -> None:
        """Dead-letter one record whose handling raised (unless the stage took care of it first)."""
        log.error("%s: record %s failed alone (%s, at %s); dead-lettering it", self.stage, _where(r),
                  bounded(repr(exc)), raised_at(exc))
        if (r.topic, r.partition, r.offset) not in self.io.handed:
            self.io.deliver([self.dlq(r, f"internal: {self.stage} failed: {exc!r}")], [r])

    async def idle(self) -> None:
        """Called when a poll returned nothing (stages with timers use it)."""


MAX_LOGGED_CHARS = 300
"""The most of a value (an exception's repr, a reason) one log line quotes: a reason may quote
input, and a client must not be able to fill the logs with it."""


def bounded(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def raised_at(exc: BaseException) -> str:
    """Where in the code ``exc`` was raised (file:line in function): a bug's place, without
    the exception's text, which may quote input."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "unknown"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _where(r: ConsumerRecord) -> str:
    return f"{r.topic}[{r.partition}]@{r.offset}"
