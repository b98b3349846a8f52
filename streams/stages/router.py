"""The router stage: its record loop, thin glue around ``streams.stages.routing.Router``. Each
polled batch is routed concurrently; each record is finished when its outputs are with the
broker; a co-located encoder may take a request's jobs over in process (``router.colocate``).
The routing rules themselves (trust, reply topics, refs, quotas, admission) are
``streams.stages.routing``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import faust
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import unpack
from schemas.errors import ErrorCode
from schemas.jobs import Verdict
from schemas.settings import Settings
from schemas.topics import TopicNames
from schemas.trace import now_ms
from streams.connection import client_kwargs
from streams.observe.metrics import Metrics
from streams.policies.admission import Backpressure
from streams.policies.load import LoadView
from streams.policies.pacing import LargeRecordPacing, Pacing
from streams.policies.quota import TenantLabels
from streams.reply_topics import TopicCache
from streams.policies.direct import Action
from streams.policies.gen_price import costliest
from streams.policies.step_back import StepBack
from streams.runtime import priority
from streams.runtime.joint import Joint
from streams.runtime.recovery import Recovered, recover
from streams.runtime.produce import Out
from streams.runtime.stage import RecordStage, bounded, raised_at
from streams.stages.direct import DirectAnswers, eligible
from streams.stages.routing import JobOut, Routed, Router
from streams.stores import claim_sweep, load_reports
from streams.stores.result_cache import ResultCache
from workers.claims import ClaimSizer
from workers.image_header import HEAD_BYTES
from workers.redisconn import connect_async

if TYPE_CHECKING:
    from streams.stages.encoder import EncoderStage, LocalEncoder

log = logging.getLogger(__name__)

ROUTED_AT_ONCE = 32
"""Records of one poll routed concurrently. A poll holds up to 500 (a backlog read after a
restart, or a tenant's topics taken again after a hold): routed all at once, each one's Redis
round trips (its refs sized, the whole answer looked up) wait behind every other's parsing and
pricing on the loop, past the client's 200 ms timeout (one run answered 498 of a held
tenant's requests ``internal``, their refs unsized; none in the runs since), and none is
refused for the quota the first ones spent until all are priced. In groups, a group's quota
decisions stand before the next is read, so a tenant put in debt by one request has the rest
refused unpriced."""

RECOVERY_ATTEMPTS = 3
"""Reads of the router's done markers on a take-over before its partitions are served without
direct answers."""


class RouterStage(RecordStage):
    """The router's record loop: each polled batch is routed concurrently (their result-cache
    lookups overlap), and each record is finished when its outputs are with the broker.

    With an authenticating broker it subscribes by pattern to the shared and every tenant's
    ingress topics (new tenants' topics are found within ``router.topic_cache_s``)."""

    stage = "route"

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics,
                 colocated: dict[str, "LocalEncoder"] | None = None) -> None:
        names = TopicNames(settings.kafka.topic_prefix)
        pattern = names.ingress_pattern() if settings.kafka.authenticated else None
        super().__init__(app, settings, [names.ingress("rt")], [names.ingress("bulk")], pattern=pattern)
        self.metrics = metrics
        self.topic_cache = TopicCache(settings.kafka.bootstrap, settings.router.topic_cache_s, client_kwargs(settings))
        self.load = LoadView()
        results = ResultCache(settings.redis.url, settings.cache.ttl_result_s, tls_ca=settings.redis.tls_ca) \
            if settings.cache.enabled and settings.cache.whole_result else None
        self.redis = connect_async(settings.redis.url, settings.redis.tls_ca, socket_timeout=0.2,
                                   socket_connect_timeout=0.2)
        lim = settings.limits
        sizer = ClaimSizer(self.redis, Path(lim.ref_file_root) if lim.ref_file_root else None, lim.claim_ttl_s,
                           head_bytes=HEAD_BYTES)
        self.router = Router(settings, self.topic_cache.exists, self.load, results, ref_sizes=sizer.sizes)
        self.direct = DirectAnswers(self.names, metrics, results, float(settings.assembler.retention_ms),
                                    self.router.replies.default, self.tenant_of_topic) \
            if settings.router.answer_local and colocated else None
        """Requests this router answers itself (``router.answer_local``), or None."""
        self.tenant_labels = TenantLabels(settings.quota.metric_tenants)
        adm = settings.admission
        self.backpressure = Backpressure(adm.backpressure_high_ms, adm.backpressure_low_ms)
        self.colocated = dict(colocated or {})
        """Encode topic -> the encoder running in this process that may take its jobs over."""
        self.observe_failures = 0
        self.handover_failures = 0
        self.raise_ = priority.Raise.held(settings.local.nice_of("router"),
                                          StepBack(settings.router.step_back_rate, settings.router.step_back_hold_s),
                                          self._moved)
        """The CPU priority this router runs ahead of the pools at (``local.nice``), given back
        while the box is past capacity; None when it runs at the others' level."""
        if self.pattern is not None and settings.router.large_record_bytes_per_s > 0:
            self.pacing = LargeRecordPacing(settings.router.large_record_bytes_per_s, settings.router.large_record_bytes)
        if self.pattern is not None and settings.router.turn_records > 0:
            self.turn_records = settings.router.turn_records
        self.refusals = Pacing(settings.router.refused_per_s) \
            if self.pattern is not None and settings.router.refused_per_s > 0 else None
        """How many of one tenant's requests refused for its own quota the router reads per
        second while others are served (``streams.policies.pacing``), or None."""

    async def handle(self, records: list[ConsumerRecord]) -> None:
        epoch = self.io.epoch  # the assignment these records were read in (routing awaits)
        routed: list[Routed] = []
        for i in range(0, len(records), ROUTED_AT_ONCE):
            routed += await asyncio.gather(*(self._route(r) for r in records[i:i + ROUTED_AT_ONCE]))
        if self.refusals is not None:
            self._pace_refusals(records, routed)
        handovers: list[tuple[Joint, list[JobOut]]] = []
        try:
            for r, result in zip(records, routed):
                self._observe_safely(result)
                local = [j for j in result.jobs if j.job.topic in self.colocated]
                action = self._direct_action(r, result, local)
                if action is Action.DROP:  # a duplicate of a request this router answered
                    self.io.finish([r])
                    continue
                if action is Action.REUSED:
                    self.io.deliver(self._refusal(result), [r], epoch)
                    continue
                if not local:
                    self.io.deliver(result.outs, [r], epoch)
                    continue
                # The manifest and everything not offered wait for the encoder's answers and
                # leave with them, in one produce request (one fetch for the assembler, one
                # answer produce, one fetch for the client), unless a job goes through its topic.
                # A request answered here sends its answer instead of the manifest.
                offered = {id(j.out) for j in local}
                if action is Action.DIRECT and self.direct is not None and result.manifest and result.key:
                    joint: Joint = self.direct.joint(self.io, r, epoch, result.manifest, result.key)
                else:
                    joint = Joint(self.io, r, epoch)
                self.io.hold([r])  # finished by the joint once every delivery landed
                joint.hold([o for o in result.outs if id(o) not in offered])
                handovers.append((joint, local))
        finally:  # a record held above is taken care of: it must leave, whatever raised after it
            if handovers:
                self._hand_over(handovers)
            if self.raise_ is not None:
                self.raise_.update()

    def _direct_action(self, r: ConsumerRecord, result: Routed, local: list[JobOut]) -> Action:
        if self.direct is None or result.key is None:
            return Action.ASSEMBLER
        m = result.manifest
        ok = m is not None and eligible(m.task, m.n_parts, result.outs, len(local))
        return self.direct.decide(r, result.key, result.digest, ok)

    def _refusal(self, result: Routed) -> list[Out]:
        """A request reusing the id of one this router answered: its own error, nothing else."""
        assert self.direct is not None
        if result.manifest is not None:
            return self.direct.refusal(result.manifest)
        verdict = Verdict.from_wire(unpack(result.outs[0].value))  # the router's own answer of it, refused instead
        return self.direct.refusal(verdict)

    def tenant_of_topic(self, topic: str) -> str | None:
        """The tenant an ingress topic belongs to (None: the shared ingress, or plaintext mode)."""
        parsed = self.names.parse_ingress(topic) if self.pattern is not None else None
        return parsed[1] if parsed is not None else None

    def on_paced(self, tenant: str, seconds: float, new: bool, reason: str) -> None:
        self.metrics.tenant_paced(self.tenant_labels(tenant), seconds, new, reason)

    def others_served(self, tenant: str, now: float) -> bool:
        pacers = [p for p in (self.pacing, self.refusals) if p is not None]
        return not pacers or any(p.others_seen(tenant, now) for p in pacers)

    def turn_of(self, tenant: str) -> int:
        """A tenant refused for its quota lately (its refusal bucket short of full) gets a turn
        of what that bucket still holds, at least one record: a backlog the pacing released is
        routed a record or a few at a time, each turn's refusals within the rate, instead of
        ``turn_records`` refusals at once before the pacing holds it again."""
        most = super().turn_of(tenant)
        if self.refusals is None:
            return most
        now = time.monotonic()
        left = self.refusals.available(tenant, now)
        if left >= self.refusals.burst or not self.others_served(tenant, now):  # alone: as fast as it sends
            return most
        return max(1, min(most, int(left)))

    def _pace_refusals(self, records: list[ConsumerRecord], routed: list[Routed]) -> None:
        """Count the requests refused for their tenant's own quota (``refusals``) and hold the
        topics of a tenant past ``router.refused_per_s``; a failure here costs the pacing, never
        the records."""
        assert self.refusals is not None
        try:
            now = time.monotonic()
            self.refusals.seen({t for t in map(self.tenant_of_topic, (r.topic for r in records)) if t is not None}, now)
            refused: dict[str, float] = {}
            for result in routed:
                if result.shed is not None:
                    refused[result.shed[0]] = refused.get(result.shed[0], 0.0) + 1.0
            if refused:
                self.hold_tenants(self.refusals.take(refused, now), "refused", now)
        except Exception:
            log.exception("router: pacing refusals failed; nothing is held")

    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        if self.direct is None:
            return
        assert self.io.consumer is not None
        k = self.settings.kafka
        found: Recovered | None = None
        for attempt in range(RECOVERY_ATTEMPTS):  # the partitions stay paused meanwhile
            try:
                assert self.io.producer is not None
                self.direct.done_partitions = len(await self.io.producer.partitions_for(self.names.router_done))
                found = await recover(self.io.consumer, k.bootstrap, self.io.settings.client_kwargs,
                                      k.max_message_bytes, self.names.router_done, tps, self.direct.opens, now_ms(),
                                      self.direct.retention_ms, marker_partitions=self.direct.done_partitions,
                                      find_unseen=True)
                break
            except Exception:
                found = None
                log.exception("router: recovery of %s failed (attempt %d of %d)", tps, attempt + 1, RECOVERY_ATTEMPTS)
                await asyncio.sleep(0.5 * 2 ** attempt)
        if found is None:
            log.error("router: no recovery of %s: this assignment answers nothing of them directly", tps)
        self.direct.assigned(tps, found)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        if self.direct is not None:
            self.direct.revoked(tps)

    def _hand_over(self, handovers: list[tuple[Joint, list[JobOut]]]) -> None:
        """Offer the jobs of co-located encoders to them (one call per encoder and poll); send
        the ones they do not take through their topics."""
        by_encoder: dict[int, list[tuple[Joint, JobOut, Callable[[Out], None]]]] = {}
        for joint, jobs in handovers:
            for j in jobs:
                by_encoder.setdefault(id(self.colocated[j.job.topic]), []).append((joint, j, joint.expect()))
        untaken: dict[int, list[Out]] = {}
        for offers in by_encoder.values():
            encoder = self.colocated[offers[0][1].job.topic]
            try:
                taken = encoder.take([(j.job.job, j.cost_ms, send) for _, j, send in offers],
                                     self.settings.router.max_queued_of(encoder.modality),
                                     self.settings.router.colocate_max_part_ms)
            except Exception:  # a bug there costs the hop, never the jobs (nor the log: every poll hits it)
                self.handover_failures += 1
                if self.handover_failures % 1000 == 1:
                    log.exception("router: handing %d jobs to %s failed (%d hand-overs so far); sending them through "
                                  "its topic", len(offers), encoder.name, self.handover_failures)
                taken = [False] * len(offers)
            for (joint, j, _), took in zip(offers, taken):
                if not took:
                    joint.unexpect()
                    untaken.setdefault(id(joint), []).append(j.out)
        for joint, _ in handovers:
            if id(joint) in untaken:  # the pool must have these now, and the manifest with them
                joint.send(untaken[id(joint)])
            joint.seal()

    def lane_of_topic(self, topic: str) -> str:
        parsed = self.names.parse_ingress(topic)
        return parsed[0] if parsed is not None else "rt"

    async def _route(self, r: ConsumerRecord) -> Routed:
        origin = f"{r.topic}[{r.partition}]@{r.offset}"
        tenant = self.tenant_of_topic(r.topic)
        try:
            return await self.router.handle(r.value, r.headers, float(r.timestamp) if r.timestamp else None, origin,
                                            tenant=tenant)
        except Exception as exc:  # the router's own failure path failed too: the record alone to the DLQ
            log.error("router: failed on %s (%s, at %s)", origin, bounded(repr(exc)), raised_at(exc))
            return Routed([self.dlq(r, f"{ErrorCode.INTERNAL}: {exc!r}")], "dlq")

    def _observe_safely(self, routed: Routed) -> None:
        """Count a routed record; a failure to count costs the metric, never the record."""
        try:
            self._observe(routed)
        except Exception:
            self.observe_failures += 1
            if self.observe_failures % 1000 == 1:  # a bug hit by every record must not flood the log
                log.exception("router: could not record the metrics of a routed record (outcome %s; %d so far)",
                              routed.outcome, self.observe_failures)

    def _observe(self, routed: Routed) -> None:
        m = self.metrics
        if routed.outcome == "dlq_dropped":
            m.dlq_dropped("route")
            m.request_done("route", "dlq")
            return
        if routed.outcome == "dlq":
            m.to_dlq("route")
            m.request_done("route", "dlq")
            return
        m.request_done("route", routed.outcome, routed.code)
        if routed.parked == "dlq":  # answered, and parked too (a routing bug): the DLQ's counters see it
            m.dead_lettered("route")
        elif routed.parked == "dlq_dropped":
            m.dlq_dropped("route")
        if routed.shed is not None:
            m.tenant_shed(self.tenant_labels(routed.shed[0]), routed.shed[1])
        if routed.admission:
            m.admission(routed.lane, routed.admission)
            if self.raise_ is not None and routed.for_want_of_capacity:
                self.raise_.refused()
        if routed.outcome == "ok":
            m.observe_span("route", routed.modality, routed.lane, routed.queued_ms, routed.service_ms)

    def should_take_bulk(self) -> bool:
        """Bulk ingress waits while the rt backlog is large (rt first, as every stage) or, with
        admission on, while the pool's queued work is over the backpressure watermark (with
        hysteresis)."""
        if not self.settings.admission.enabled:
            return super().should_take_bulk()
        change = self.backpressure.update(self.load.total_ms)
        if change == "pause":
            self.metrics.admission("bulk", "defer")
            log.warning("router: holding bulk ingress (queued work %.0f ms; high %.0f, low %.0f)",
                        self.load.total_ms, self.backpressure.high_ms, self.backpressure.low_ms)
        return super().should_take_bulk() and not self.backpressure.paused

    def _moved(self, nice: int) -> None:
        self.metrics.set_cpu_nice(self.stage, nice)
        log.info("router: CPU priority %d (%s)", nice, "ahead of the pools" if nice < 0 else
                 "stepped back beside the pools: admission refuses requests for want of capacity")

    async def on_started(self) -> None:
        await super().on_started()
        if self.raise_ is not None:
            self.metrics.set_cpu_nice(self.stage, self.raise_.nice)
        self.supervise("load", self._refresh_forever)
        if self.settings.quota.claim_sweep_s > 0:
            self.supervise("claims", self._sweep_claims_forever)

    async def _refresh_forever(self) -> None:
        interval = self.settings.admission.refresh_ms / 1000.0
        prefix = self.settings.kafka.topic_prefix
        while not self.should_stop:
            try:
                self.load.update_reports(await load_reports.read_loads(self.redis, prefix), now_ms())
                self.router.models = await load_reports.read_identities(self.redis, prefix)
                if "generate" in self.router.served_tasks:  # none read (Redis down): the last cost holds
                    costs = await load_reports.read_gen_costs(self.redis, prefix)
                    if costs:
                        self.router.gen_cost = costliest(costs, now_ms(), default=self.router.gen_cost)
                    if self.router.quotas.charges_compute:
                        self.router.give_back(await load_reports.take_gen_credits(self.redis, prefix, self.router.replica),
                                               now_ms())
                self.router.partitioner.refresh(self.load.partition_ms)
                if self.direct is not None:
                    self.metrics.set_state(self.stage, keys=self.direct.entries())
            except Exception as exc:  # keep the last estimate; admission must not stop routing
                log.warning("router: could not read the encoders' load: %r", exc)
            if self.raise_ is not None:  # the raise comes back after its hold, records or not
                self.raise_.update()
            await asyncio.sleep(interval)


    async def _sweep_claims_forever(self) -> None:
        q = self.settings.quota
        while not self.should_stop:
            try:
                await claim_sweep.sweep(self.redis, q.claim_bytes, self.settings.limits.claim_ttl_s)
            except Exception as exc:  # Redis down: the next sweep catches up
                log.warning("router: claim sweep skipped: %r", exc)
            await asyncio.sleep(q.claim_sweep_s)


def install_router(app: faust.App, settings: Settings, metrics: Metrics,
                   colocated: list["EncoderStage"] | None = None) -> None:
    """The router on ``app``, with the encoders placed in its process (``router.colocate``),
    each taking the router's jobs over while it has room (and serving its own topics too,
    unless ``router.colocate_pool`` is off)."""
    topics: dict[str, LocalEncoder] = {}
    for encoder in colocated or []:
        encoder.install()
        topics.update((t, encoder.local) for t in (*encoder.rt_topics, *encoder.bulk_topics))
    RouterStage(app, settings, metrics, topics).install()
