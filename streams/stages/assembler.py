"""The assembler stage: fan-in of each request's parts, and every client-visible event of an
embed request — sent exactly once.

It reads the encoded topics (keyed by request id, so one partition holds all of a request):
manifests from the router, encoded parts from the encoders, and the router's verdicts (a
rejection or a whole cached answer). ``streams.assembly.step`` is the pure state machine;
this module keeps its state in memory and carries its decisions out:

- a request's first manifest: its ``accepted`` event;
- its last part (or its deadline, checked by a sweep in this process): its terminal event,
  or for a generate request the assembled job for the generator;
- a verdict: its events.

Exactly once, through crashes, without a state changelog: a request's input records are
finished (so their offsets can be committed) only when its answer and its *done marker*
(a small record on the compacted ``<prefix>.assembler.done`` topic) are with the broker.
A replica that takes over a partition first reads the done markers (answered requests),
then the records it is about to replay, and looks on their reply topics for events already
sent (an answer whose marker had not landed when the last owner died); the replay then
rebuilds the state of the requests still open and sends only what was never sent.

Bounds: at most ``max_pending`` open requests (new manifests past it are answered
``overloaded``), counted apart from the tombstones of answered ones; parts without a
manifest (forged or stale: a request's manifest precedes its parts on the partition) are
kept ``orphan_ttl_ms`` at most and ``max_orphans`` at most (the oldest are dropped first),
never answered; finished requests are remembered ``retention_ms`` so late duplicates are
dropped. Deadlines wait in a heap, so a sweep costs what expires, not what is open.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import faust
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import DeadlineTick, Manifest, Verdict, fan_in_from_wire
from schemas.settings import Settings
from schemas.trace import now_ms
from streams.assembly import Assembly, AssemblyPolicy, Step, step
from streams.lifecycle import RequestStatus
from streams.metrics import Metrics, request_modality
from streams.produce import Out, out_map
from streams.result_cache import ResultCache
from streams.runtime.recovery import done_marker, recover
from streams.runtime.stage import RecordStage

log = logging.getLogger(__name__)


@dataclass
class Open:
    """One request being assembled on this replica."""

    state: Assembly
    records: list[ConsumerRecord] = field(default_factory=list)
    """Its input records: finished together once it is answered."""
    accepted_sent: bool = False


@dataclass
class PartitionState:
    open: dict[str, Open] = field(default_factory=dict)
    """Requests being assembled, orphans included."""
    orphans: dict[str, float] = field(default_factory=dict)
    """Ids in ``open`` without a manifest -> when first seen (insertion order is age order)."""
    deadlines: list[tuple[float, str]] = field(default_factory=list)
    """(deadline, id) of open requests, a min-heap; stale entries are skipped when popped."""
    done: dict[str, float] = field(default_factory=dict)
    """Answered request id -> when (epoch ms): late duplicates are dropped."""
    done_order: deque[tuple[float, str]] = field(default_factory=deque)
    sent: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    """Events a previous owner already sent for requests being replayed."""

    def mark_done(self, rid: str, at: float) -> None:
        self.done[rid] = at
        self.done_order.append((at, rid))

    def close(self, rid: str) -> Open | None:
        """Stop tracking ``rid`` as open (answered, dropped or overtaken by a verdict)."""
        self.orphans.pop(rid, None)
        return self.open.pop(rid, None)

    @property
    def pending(self) -> int:
        """Open requests that have their manifest (what ``max_pending`` bounds)."""
        return len(self.open) - len(self.orphans)


class AssemblerStage(RecordStage):
    stage = "assemble"

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics) -> None:
        names_prefix = settings.kafka.topic_prefix
        super().__init__(app, settings, [f"{names_prefix}.encoded.rt"], [f"{names_prefix}.encoded.bulk"])
        a = settings.assembler
        self.metrics = metrics
        self.policy = AssemblyPolicy(retention_ms=float(a.retention_ms), orphan_ttl_ms=float(a.orphan_ttl_ms))
        self.max_pending = a.max_pending
        self.max_orphans = a.max_orphans
        self.sweep_s = a.sweep_interval_ms / 1000.0
        self.partitions: dict[TopicPartition, PartitionState] = {}
        self.orphans_dropped = 0
        self.results = (ResultCache(settings.redis.url, settings.cache.ttl_result_s)
                        if settings.cache.enabled and settings.cache.whole_result else None)

    # -- records -------------------------------------------------------------------------

    async def handle(self, records: list[ConsumerRecord]) -> None:
        now = now_ms()
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            part = self.partitions.get(tp)
            if part is None:  # revoked while this batch was on its way
                continue
            try:
                msg = fan_in_from_wire(unpack(r.value))
            except (DecodeError, ValueError, TypeError, RecursionError) as exc:
                self.metrics.to_dlq(self.stage)
                self.io.deliver([self.dlq(r, f"invalid_request: undecodable fan-in message: {exc}")], [r])
                continue
            self._apply(part, r, msg, now)

    def _apply(self, part: PartitionState, r: ConsumerRecord, msg: Any, now: float) -> None:
        rid = msg.id
        if rid in part.done or isinstance(msg, DeadlineTick):
            self.io.finish([r])  # a late duplicate (or a tick from an older version): nothing to do
            return
        if isinstance(msg, Verdict):
            self._verdict(part, r, msg, now)
            return
        entry = part.open.get(rid)
        opens = isinstance(msg, Manifest) and (entry is None or entry.state.manifest is None)
        if opens and self._open_count() >= self.max_pending:
            self._overloaded(part, r, msg, now)
            return
        if entry is None:
            if not isinstance(msg, Manifest) and self._orphan_count() >= self.max_orphans:
                self._drop_oldest_orphan()
            entry = Open(Assembly(status=RequestStatus.ACCEPTED, first_seen_ms=now, lane=self.lane_of(r)))
            part.open[rid] = entry
            if not isinstance(msg, Manifest):
                part.orphans[rid] = now
        result = step(entry.state, msg, now, self.policy, lane=self.lane_of(r))
        if not result.changed:
            self.io.finish([r])  # a duplicate part or manifest: the first one counts
            return
        entry.records.append(r)
        entry.state = result.state
        if opens and entry.state.manifest is not None:
            part.orphans.pop(rid, None)
            heapq.heappush(part.deadlines, (entry.state.manifest.deadline_at_ms, rid))
        if isinstance(msg, Manifest) and not entry.accepted_sent:
            entry.accepted_sent = True
            m = msg
            accepted = Event(m.id, EventKind.ACCEPTED, 0, m.accepted_at_ms,
                             payload={"task": m.task, "parts": m.n_parts, "deadline_at_ms": m.deadline_at_ms})
            if ("accepted", 0) not in part.sent.get(rid, ()):
                self.io.deliver([out_map(m.reply_to, m.id, accepted.to_wire())])
        if result.emit is not None or result.forward is not None:
            self._answer(part, rid, entry, result)

    def _answer(self, part: PartitionState, rid: str, entry: Open, result: Step) -> None:
        state = result.state
        assert state is not None and state.manifest is not None
        m = state.manifest
        outs: list[Out] = []
        if result.forward is not None:  # a generate request goes on; the generator answers it
            outs.append(out_map(self.names.generate(result.forward.lane), m.id, result.forward.to_wire()))
            self.metrics.request_done(self.stage, "ok")
        elif result.emit is not None:
            if ("terminal", result.emit.seq) not in part.sent.get(rid, ()):
                outs.append(out_map(m.reply_to, m.id, result.emit.to_wire()))
            _observe_terminal(self.metrics, result.emit, state)
            if self.results is not None and m.result_key and state.status == RequestStatus.FINISHED:
                asyncio.ensure_future(self.results.put(m.result_key, result.emit.payload or {}))  # complete answers only
        outs.append(self._done_marker(rid, m.reply_to, state.done_at_ms or now_ms()))
        self.io.deliver(outs, entry.records)
        part.close(rid)
        part.sent.pop(rid, None)
        part.mark_done(rid, state.done_at_ms or now_ms())

    def _verdict(self, part: PartitionState, r: ConsumerRecord, v: Verdict, now: float) -> None:
        sent = part.sent.pop(v.id, set())
        outs = []
        for ev in v.events:
            mark = ("terminal", ev.get("seq")) if ev.get("kind") in ("result", "error") else (ev.get("kind"), ev.get("seq"))
            if mark not in sent:
                outs.append(out_map(v.reply_to, v.id, ev))
        outs.append(self._done_marker(v.id, v.reply_to, now))
        self.io.deliver(outs, [r])
        stray = part.close(v.id)  # parts of a request the router answered itself
        if stray is not None:
            self.io.finish(stray.records)
        part.mark_done(v.id, now)

    def _overloaded(self, part: PartitionState, r: ConsumerRecord, m: Manifest, now: float) -> None:
        err = WireError(ErrorCode.OVERLOADED, "the assembler is tracking its maximum of requests")
        ev = Event(m.id, EventKind.ERROR, 0, now, error=err.to_wire())
        self.io.deliver([out_map(m.reply_to, m.id, ev.to_wire()), self._done_marker(m.id, m.reply_to, now)], [r])
        part.mark_done(m.id, now)
        self.metrics.request_done(self.stage, "error", str(ErrorCode.OVERLOADED))

    def _done_marker(self, rid: str, reply_to: str, at: float) -> Out:
        return done_marker(self.names.assembler_done, rid, reply_to, at)

    def _open_count(self) -> int:
        return sum(p.pending for p in self.partitions.values())

    def _orphan_count(self) -> int:
        return sum(len(p.orphans) for p in self.partitions.values())

    def _drop_oldest_orphan(self) -> None:
        """Past ``max_orphans``: the oldest orphan of any partition goes, unanswered."""
        oldest = min((p for p in self.partitions.values() if p.orphans),
                     key=lambda p: next(iter(p.orphans.values())), default=None)
        if oldest is None:
            return
        rid = next(iter(oldest.orphans))
        entry = oldest.close(rid)
        if entry is not None:
            self.io.finish(entry.records)
        self.orphans_dropped += 1

    # -- time ----------------------------------------------------------------------------

    async def on_started(self) -> None:
        await super().on_started()
        self.supervise("sweep", self._sweep_forever)

    async def _sweep_forever(self) -> None:
        while not self.should_stop:
            await asyncio.sleep(self.sweep_s)
            try:
                self.sweep(now_ms())
            except Exception:  # the sweep must outlive its own bugs: deadlines depend on it
                log.exception("assembler: sweep failed; next one in %.1fs", self.sweep_s)

    def sweep(self, now: float) -> None:
        """Deadlines, expired orphans and expired tombstones. Orphans (parts without a
        manifest) are finished unanswered: forged or stale, they never complete a request."""
        for part in list(self.partitions.values()):
            while part.orphans:
                rid, seen = next(iter(part.orphans.items()))
                if now - seen < self.policy.orphan_ttl_ms:
                    break
                entry = part.close(rid)
                if entry is not None:
                    self.io.finish(entry.records)
            while part.deadlines and part.deadlines[0][0] <= now:
                _, rid = heapq.heappop(part.deadlines)
                entry = part.open.get(rid)
                if entry is None or entry.state.manifest is None:
                    continue  # answered already
                result = step(entry.state, DeadlineTick(rid), now, self.policy, lane=entry.state.lane)
                if result.emit is not None or result.forward is not None:
                    entry.state = result.state
                    self._answer(part, rid, entry, result)
            while part.done_order and now - part.done_order[0][0] >= self.policy.retention_ms:
                at, rid = part.done_order.popleft()
                if part.done.get(rid) == at:
                    del part.done[rid]
        self.metrics.set_inflight(self.stage, self._open_count())
        self.metrics.set_state(self.stage, open=self._open_count(), orphans=self._orphan_count(),
                               tombstones=sum(len(p.done) for p in self.partitions.values()))

    # -- ownership -----------------------------------------------------------------------

    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        started = now_ms()
        for tp in tps:
            self.partitions[tp] = PartitionState()
        assert self.io.consumer is not None
        k = self.settings.kafka
        try:
            found = await recover(self.io.consumer, k.bootstrap, self.io.settings.client_kwargs, k.max_message_bytes,
                                  self.names.assembler_done, tps, _opens, started, self.policy.retention_ms)
        except Exception:
            log.exception("assembler: recovery of %s failed; replayed requests may be answered again", tps)
            return
        for tp, done in found.done.items():
            part = self.partitions[tp]
            for rid, at in sorted(done.items(), key=lambda kv: kv[1]):
                part.mark_done(rid, at)
            part.sent.update(found.sent)  # ids are unique to their partition; extra keys are harmless
        log.info("assembler: took over %s in %.0f ms", sorted(f"{t.topic}[{t.partition}]" for t in tps),
                 now_ms() - started)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self.partitions.pop(tp, None)  # the next owner replays what was open here


def _opens(rec: ConsumerRecord) -> tuple[str, str] | None:
    """(id, reply topic) of a record that opens a request the assembler answers."""
    msg = fan_in_from_wire(unpack(rec.value))
    return (msg.id, msg.reply_to) if isinstance(msg, (Manifest, Verdict)) else None


def _where(r: ConsumerRecord) -> str:
    return f"{r.topic}[{r.partition}]@{r.offset}"


def _observe_terminal(metrics: Metrics, event: Event, state: Assembly | None) -> None:
    manifest = state.manifest if state else None
    modality = request_modality(manifest.modalities) if manifest else "text"
    lane = manifest.lane if manifest else "rt"
    timings = event.timings or {}
    for st in timings.get("stages", []):
        if st["stage"] == "assemble":
            metrics.observe_span("assemble", modality, lane, st["queued_ms"], st["service_ms"])
    if "e2e_ms" in timings:
        metrics.observe_e2e(modality, lane, timings["e2e_ms"])
    if event.error:
        metrics.request_done("assemble", "error", event.error.get("code"))
    else:
        metrics.request_done("assemble", "ok")


def install_assembler(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    AssemblerStage(app, settings, metrics).install()
