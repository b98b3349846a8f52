"""The assembler stage: fan-in of each request's parts, and every client-visible event of an
embed request — sent exactly once.

It reads the encoded topics (keyed ``<tenant>/<id>``, so one partition holds all of a
request): manifests from the router, encoded parts from the encoders, and the router's
verdicts (a rejection or a whole cached answer). ``streams.policies.assembly.step`` is the pure state
machine; this module keeps its state in memory, per request key (a tenant's id is its own:
the same id from two tenants is two requests), and carries its decisions out:

- a request's first manifest: its ``accepted`` event, held up to ``accepted_linger_ms`` so that
  a request answered within it gets both events in one produce (and its client one fetch);
- its last part (or its deadline, checked by a sweep in this process): its terminal event,
  or for a generate request the assembled job for the generator;
- a verdict: its events;
- a manifest or verdict of another ingress record with the key of a request open or
  recently answered (a reused id): an ``invalid_request`` error to its own reply topic.
  The first request goes on untouched; nothing is swallowed.

Exactly once, through crashes, without a state changelog: a request's input records are
finished (so their offsets can be committed) only when its answer and its *done marker*
(a small record on the compacted ``<prefix>.assembler.done`` topic) are with the broker.
A replica that takes over a partition first reads the done markers (answered requests),
then the records it is about to replay, and looks on their reply topics for events already
sent (an answer whose marker had not landed when the last owner died); the replay then
rebuilds the state of the requests still open and sends only what was never sent.

Trust and bounds: a part counts only with its request's nonce (``streams.policies.assembly``); parts
that come before their manifest ("orphans": forged or stale, since a request's manifest
precedes its parts on the partition) are held at most ``orphan_ttl_ms`` and at most
``max_orphans`` requests' worth at a time (the oldest are dropped first), and never answered;
the whole answer is cached only for a manifest with a nonce. At most ``max_pending`` open
requests, counted apart from orphans and tombstones (new manifests past it are answered
``overloaded``); finished requests are remembered ``retention_ms`` so late duplicates are
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
from schemas.jobs import DeadlineTick, EncodedPart, Manifest, RetrieveJob, Verdict, fan_in_from_wire, request_key
from schemas.request import TENANT_RE
from schemas.settings import Settings
from schemas.topics import TopicNames
from schemas.trace import now_ms
from streams.policies.assembly import (Assembly, AssemblyPolicy, Intake, KeyView, Step, accepted_event, intake, reused_id,
                                       step)
from streams.policies.lifecycle import RequestStatus
from streams.observe.metrics import Metrics, observe_terminal
from streams.runtime.linger import Held, Linger, take
from streams.runtime.produce import Out, out_map
from streams.stores.result_cache import ResultCache
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
    accepted: Held | None = None
    """Its accepted event, held to leave with the answer (``accepted_linger_ms``)."""


@dataclass
class PartitionState:
    open: dict[str, Open] = field(default_factory=dict)
    """Request key (``<tenant>/<id>``) -> its state, orphans included."""
    orphans: dict[str, float] = field(default_factory=dict)
    """Keys in ``open`` without a manifest -> when first seen (insertion order is age order)."""
    deadlines: list[tuple[float, str]] = field(default_factory=list)
    """(deadline, key) of open requests, a min-heap; stale entries are skipped when popped."""
    done: dict[str, float] = field(default_factory=dict)
    """Answered request key -> when (epoch ms): late duplicates are dropped."""
    digests: dict[str, str] = field(default_factory=dict)
    """Answered request key -> the digest of the ingress record answered (when known)."""
    done_order: deque[tuple[float, str]] = field(default_factory=deque)
    sent: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    """Events a previous owner already sent for requests being replayed."""

    def close(self, key: str) -> Open | None:
        """Stop tracking ``key`` as open (answered, dropped or overtaken by a verdict)."""
        self.orphans.pop(key, None)
        return self.open.pop(key, None)

    @property
    def pending(self) -> int:
        """Open requests that have their manifest (what ``max_pending`` bounds)."""
        return len(self.open) - len(self.orphans)

    def mark_done(self, key: str, at: float, digest: str | None = None) -> None:
        self.done[key] = at
        if digest is not None:
            self.digests[key] = digest
        self.done_order.append((at, key))


def fan_in_key(msg: Any) -> str | None:
    """The request key a fan-in message belongs to; None for one that names no valid tenant
    (no stage of the pipeline makes such a record)."""
    tenant = getattr(msg, "tenant", None)
    if tenant is None and isinstance(msg, (EncodedPart, DeadlineTick)):
        tenant = "default"  # a part from an encoder older than tenant-scoped keys
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        return None
    return request_key(tenant, msg.id)


class AssemblerStage(RecordStage):
    stage = "assemble"

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics) -> None:
        names = TopicNames(settings.kafka.topic_prefix)
        super().__init__(app, settings, [names.encoded("rt")], [names.encoded("bulk")])
        a = settings.assembler
        self.metrics = metrics
        self.policy = AssemblyPolicy(retention_ms=float(a.retention_ms), orphan_ttl_ms=float(a.orphan_ttl_ms))
        self.max_pending = a.max_pending
        self.max_orphans = a.max_orphans
        self.accepted_linger = Linger(a.accepted_linger_ms, self.io.deliver)
        self.sweep_s = a.sweep_interval_ms / 1000.0
        self.orphans_dropped = 0
        self.partitions: dict[TopicPartition, PartitionState] = {}
        self.results = (ResultCache(settings.redis.url, settings.cache.ttl_result_s, tls_ca=settings.redis.tls_ca)
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
                key = fan_in_key(msg)
                if key is None:
                    raise ValueError("the message names no valid tenant")
            except (DecodeError, ValueError, TypeError, RecursionError) as exc:
                self.metrics.to_dlq(self.stage)
                self.io.deliver([self.dlq(r, f"invalid_request: undecodable fan-in message: {exc}")], [r])
                continue
            self._apply(part, r, msg, key, now)
            self.io.hold([r])  # in the request's state (or answered): never handled twice

    def _apply(self, part: PartitionState, r: ConsumerRecord, msg: Any, key: str, now: float) -> None:
        entry = part.open.get(key)
        manifest = entry.state.manifest if entry is not None else None
        view = KeyView(answered=key in part.done, answered_digest=part.digests.get(key), tracked=entry is not None,
                       manifest_digest=manifest.digest if manifest is not None else None,
                       has_manifest=manifest is not None, open_requests=self._open_count(),
                       orphans=self._orphan_count())
        decision = intake(msg, view, self.max_pending, self.max_orphans)
        if decision.action is Intake.IGNORE:
            self.io.finish([r])
            return
        if decision.action is Intake.REUSED_ID:
            self._refuse(r, msg, now)
            return
        if decision.action is Intake.VERDICT:
            self._verdict(part, r, key, msg, now)
            return
        if decision.action is Intake.OVERLOADED:
            self._overloaded(part, r, key, msg, now)
            return
        opens = decision.opens
        if entry is None:
            if decision.evict_orphan:
                self._drop_oldest_orphan()
            entry = Open(Assembly(status=RequestStatus.ACCEPTED, first_seen_ms=now, lane=self.lane_of(r)))
            part.open[key] = entry
            if not isinstance(msg, Manifest):
                part.orphans[key] = now
        result = step(entry.state, msg, now, self.policy, lane=self.lane_of(r))
        if result.refused is not None or not result.changed:
            if not entry.records and entry.state.manifest is None:
                part.close(key)  # an orphan entry that never held anything
            if result.refused is not None:
                self._refuse(r, msg, now, result.refused)
            else:
                self.io.finish([r])  # a duplicate part or manifest, or a part that is not this request's
            return
        if opens and result.state is not None and result.state.manifest is not None:
            part.orphans.pop(key, None)  # the parts it held are the request's now (or dropped by it)
            heapq.heappush(part.deadlines, (result.state.manifest.deadline_at_ms, key))
        entry.records.append(r)
        entry.state = result.state
        if isinstance(msg, Manifest) and not entry.accepted_sent:
            entry.accepted_sent = True
            if ("accepted", 0) not in part.sent.get(key, ()):
                entry.accepted = self.accepted_linger.hold(out_map(msg.reply_to, msg.id, accepted_event(msg).to_wire()),
                                                           now)
        if result.emit is not None or result.forward is not None:
            self._answer(part, key, entry, result)

    def _answer(self, part: PartitionState, key: str, entry: Open, result: Step) -> None:
        state = result.state
        assert state is not None and state.manifest is not None
        m = state.manifest
        outs: list[Out] = []
        if (accepted := take(entry.accepted)) is not None:  # still held: it leaves first, with the answer
            outs.append(accepted)
        if result.forward is not None:  # goes on to the generator or the retrieve stage, which answers it
            f = result.forward
            topic = self.names.retrieve(f.lane) if isinstance(f, RetrieveJob) else self.names.generate(f.lane)
            outs.append(out_map(topic, key, f.to_wire()))
            self.metrics.request_done(self.stage, "ok")
        elif result.emit is not None:
            if ("terminal", result.emit.seq) not in part.sent.get(key, ()):
                outs.append(out_map(m.reply_to, m.id, result.emit.to_wire()))
            observe_terminal(self.metrics, result.emit, m)
            if (self.results is not None and m.result_key and m.nonce is not None
                    and state.status == RequestStatus.FINISHED):  # complete answers of the pipeline's own parts only
                asyncio.ensure_future(self.results.put(m.result_key, result.emit.payload or {}))
        outs.append(self._done_marker(key, m.reply_to, state.done_at_ms or now_ms(), m.digest))
        self.io.deliver(outs, entry.records)
        part.close(key)
        part.sent.pop(key, None)
        part.mark_done(key, state.done_at_ms or now_ms(), m.digest)

    def _verdict(self, part: PartitionState, r: ConsumerRecord, key: str, v: Verdict, now: float) -> None:
        """The router's own answer (``intake`` checked it answers no request open here)."""
        stray = part.open.get(key)
        sent = part.sent.pop(key, set())
        outs = []
        for ev in v.events:
            mark = ("terminal", ev.get("seq")) if ev.get("kind") in ("result", "error") else (ev.get("kind"), ev.get("seq"))
            if mark not in sent:
                outs.append(out_map(v.reply_to, v.id, ev))
        outs.append(self._done_marker(key, v.reply_to, now, v.digest))
        self.io.deliver(outs, [r])
        if stray is not None:  # parts without a manifest under the key of a request the router answered itself
            part.close(key)
            self.io.finish(stray.records)
        part.mark_done(key, now, v.digest)

    def _refuse(self, r: ConsumerRecord, msg: Manifest | Verdict, now: float, event: Event | None = None) -> None:
        """Answer a request that reuses the id of another (open or just answered): its own
        error, to its own reply topic; the other request is not touched."""
        ev = event if event is not None else reused_id(msg, now)
        self.io.deliver([out_map(msg.reply_to, msg.id, ev.to_wire())], [r])
        self.metrics.request_done(self.stage, "error", str(ErrorCode.INVALID_REQUEST))

    def _overloaded(self, part: PartitionState, r: ConsumerRecord, key: str, m: Manifest, now: float) -> None:
        err = WireError(ErrorCode.OVERLOADED, "the assembler is tracking its maximum of requests")
        ev = Event(m.id, EventKind.ERROR, 0, now, error=err.to_wire())
        self.io.deliver([out_map(m.reply_to, m.id, ev.to_wire()), self._done_marker(key, m.reply_to, now, m.digest)],
                        [r])
        part.mark_done(key, now, m.digest)
        self.metrics.request_done(self.stage, "error", str(ErrorCode.OVERLOADED))

    def _done_marker(self, key: str, reply_to: str, at: float, digest: str | None) -> Out:
        return done_marker(self.names.assembler_done, key, reply_to, at, digest)

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
        key = next(iter(oldest.orphans))
        entry = oldest.close(key)
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
                key, seen = next(iter(part.orphans.items()))
                if now - seen < self.policy.orphan_ttl_ms:
                    break
                entry = part.close(key)
                if entry is not None:
                    self.io.finish(entry.records)
            while part.deadlines and part.deadlines[0][0] <= now:
                _, key = heapq.heappop(part.deadlines)
                entry = part.open.get(key)
                if entry is None or entry.state.manifest is None:
                    continue  # answered already
                result = step(entry.state, DeadlineTick(entry.state.manifest.id), now, self.policy,
                              lane=entry.state.lane)
                if result.emit is not None or result.forward is not None:
                    entry.state = result.state
                    self._answer(part, key, entry, result)
            while part.done_order and now - part.done_order[0][0] >= self.policy.retention_ms:
                at, key = part.done_order.popleft()
                if part.done.get(key) == at:
                    del part.done[key]
                    part.digests.pop(key, None)
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
            for key, at in sorted(done.items(), key=lambda kv: kv[1]):
                part.mark_done(key, at, found.digests.get(key))
            part.sent.update(found.sent)  # keys are unique to their partition; extra keys are harmless
        log.info("assembler: took over %s in %.0f ms", sorted(f"{t.topic}[{t.partition}]" for t in tps),
                 now_ms() - started)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            part = self.partitions.pop(tp, None)  # the next owner replays what was open here
            for entry in part.open.values() if part is not None else ():
                take(entry.accepted)  # its next owner sends it


def _opens(rec: ConsumerRecord) -> tuple[str, str, str] | None:
    """(request key, reply topic, id) of a record that opens a request the assembler answers."""
    msg = fan_in_from_wire(unpack(rec.value))
    if not isinstance(msg, (Manifest, Verdict)):
        return None
    key = fan_in_key(msg)
    return (key, msg.reply_to, msg.id) if key is not None else None


def install_assembler(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    AssemblerStage(app, settings, metrics).install()
