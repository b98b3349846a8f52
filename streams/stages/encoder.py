"""The encode stage: one modality's encode jobs in, one encoded part per job out. Glue around
an ``EncoderCore`` (``streams.cores.encoder``: queues, micro-batcher, cost model, prep and
engine threads, the direct path), which knows no Kafka.

The record loop (``handle``) decodes jobs (undecodable ones are dead-lettered alone) and
submits them to the core with their record; each ``EncodeAnswer`` the core gives back becomes
an ``EncodedPart`` on ``mm.encoded.<lane>``, delivered with its record (which is finished,
committable, once the output is with the broker).

A co-located router (``router.colocate``: this stage in the router's process) hands jobs
over to its ``LocalEncoder`` (the core behind the placement policy) instead of through the
encode topic while this replica has room
(with ``router.colocate_pool`` off it takes only those, reads no topic and reports no load):
they skip a broker hop, are queued and batched like the rest, and their outputs go back
through the router's own producer (after the request's manifest, so the assembler sees the
parts of a request in order), which finishes the ingress record once every one of them is
with the broker.

Intake is bounded by the runtime's ``poll_budget``: no poll takes more than the room left
under ``max_queue`` jobs held (preparing, queued or running), none is taken while the jobs
held carry ``max_queue_bytes`` of payload (so what they hold stays under it plus one poll), and
at none the runtime pauses the stage's topics until a job is answered. Bulk jobs may hold at most half of it
(``BULK_SHARE``): a flood of bulk work cannot fill the stage and leave rt records waiting in
the topic, where no fair order reaches them. A few times a second the stage reports its
queued work (ms, per partition) and what one more item costs it, for the router's admission
(``streams.policies.load``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import faust
from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob, request_key
from schemas.settings import Settings
from schemas.tensor import to_wire
from schemas.topics import TopicNames
from schemas.trace import Span, now_ms
from streams.stores import load_reports
from streams.cores.encoder import EncodeAnswer, EncoderCore
from streams.policies.load import merge_item_costs, tenant_shares
from streams.observe.metrics import Metrics
from streams.policies.placement import Offer, take_local
from streams.runtime.priority import Lowered
from streams.runtime.produce import Out, out_map
from streams.runtime.stage import RecordStage
from workers.calibration import CalibrationCache
from workers.outputs import Encoded, EncoderRunner
from workers.redisconn import connect_async

log = logging.getLogger(__name__)

REPORT_S = 0.25
BULK_SHARE = 0.5
"""Largest share of ``max_queue`` bulk jobs may hold; the rest is always rt's."""


@dataclass(frozen=True, slots=True)
class Local:
    """Where a job handed over in this process came from: no record of its own; its output
    goes back through ``send``."""

    send: Callable[[Out], None]


class LocalEncoder:
    """What a router in this process hands jobs to: the encoder's core behind the placement
    policy, no stage and no topic in between."""

    def __init__(self, name: str, modality: str, core: EncoderCore, room: Callable[[], int]) -> None:
        self.name, self.core, self.room = name, core, room
        self.modality = modality  # the router's bounds are per modality (``router.max_queued_of``)

    def take(self, offers: list[tuple[EncodeJob, float, Callable[[Out], None]]], max_queued_ms: float,
             max_part_ms: float) -> list[bool]:
        """Jobs of a co-located router, each with its predicted ms and where its output goes:
        per job, whether the core took it (else it goes through the encode topic). Taken while
        the stage has ``room``, the predicted work queued ahead of it in its lane is at most
        ``max_queued_ms`` and its own at most ``max_part_ms`` (``streams.policies.placement``)."""
        core = self.core
        taken = take_local([Offer(job.lane, ms) for job, ms, _ in offers], core.queued_ms("rt"),
                           core.queued_ms("bulk"), self.room(), max_queued_ms, max_part_ms)
        # A job taken here skips the hop and is taken only onto a short queue: what it waits
        # says nothing of the pool's waits, so it does not teach the core's calibration.
        core.submit([(unpredicted(job), "bulk" if job.lane == "bulk" else "rt", Local(send))
                     for (job, _, send), took in zip(offers, taken) if took])
        return taken


def unpredicted(job: EncodeJob) -> EncodeJob:
    return job if job.predicted_wait_ms is None else dataclasses.replace(job, predicted_wait_ms=None)


class EncoderStage(RecordStage):
    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, modality: str, runner: EncoderRunner,
                 wire_dtype: str = "float16", group_id: str | None = None, intake: bool = True,
                 thread_nice: int = 0, debt_nice: int = 0) -> None:
        """``thread_nice``: the engine's threads that much below the process's others (an encoder
        placed in the router); ``debt_nice``: the whole process that much lower while it runs a
        batch of work admitted in debt alone (a pool's, ``quota.debt_nice``; never the router's)."""
        names = TopicNames(settings.kafka.topic_prefix)
        super().__init__(app, settings, [names.encode(modality, "rt")], [names.encode(modality, "bulk")],
                         group_id=group_id, intake=intake)
        self.stage = f"encode.{modality}"
        self.modality = modality
        self.metrics = metrics
        self.runner = runner
        self.wire_dtype = wire_dtype
        self.core = EncoderCore(runner, settings.encoder, modality, self._answered,
                                _Observer(metrics, self.stage, self._modality), max_frames=settings.video.max_frames,
                                thread_nice=thread_nice)
        if debt_nice > 0:
            base = settings.local.nice_of(self.stage)
            self.core.hold_background = Lowered(
                base, debt_nice, on_move=lambda nice: metrics.set_cpu_nice(self.stage, nice, lowered=nice > base)).hold
        self.max_queue = settings.encoder.max_queue
        self.max_queue_bytes = settings.encoder.max_queue_bytes
        self.local = LocalEncoder(self.stage, self.modality, self.core, self.poll_budget)
        """What a co-located router hands jobs to (``router.colocate``)."""
        self.replica = f"{self.stage}/{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.redis = connect_async(settings.redis.url, settings.redis.tls_ca, socket_timeout=0.2,
                                   socket_connect_timeout=0.2)

    # -- intake --------------------------------------------------------------------------

    async def handle(self, records: list[ConsumerRecord]) -> None:
        jobs: list[tuple[EncodeJob, str, ConsumerRecord]] = []
        for r in records:
            try:
                job = EncodeJob.from_wire(unpack(r.value))
            except (DecodeError, ValueError, TypeError, RecursionError) as exc:
                self.metrics.to_dlq(self.stage)
                self.metrics.request_done(self.stage, "dlq")
                self.io.deliver([self.dlq(r, f"invalid_request: undecodable encode job: {exc}")], [r])
                continue
            jobs.append((job, "bulk" if r.topic in self.bulk_topics else "rt", r))
        if not jobs:
            return
        self.io.hold(r for _, _, r in jobs)
        self.core.submit(jobs)

    def should_take_bulk(self) -> bool:
        return (self.core.held_bulk < self.max_queue * BULK_SHARE
                and self.backlog_rt() <= self.rt_backlog_records and not self.core.queues["rt"])

    def poll_budget(self) -> int:
        """No poll takes more than the room left in jobs, and none while the jobs held carry
        ``max_queue_bytes`` (at 0 the runtime pauses the topics)."""
        if self.core.held and self.core.held_bytes >= self.max_queue_bytes:
            return 0
        return max(0, self.max_queue - self.core.held)

    # -- the engine ----------------------------------------------------------------------

    async def on_started(self) -> None:
        await super().on_started()
        e = self.settings.encoder
        try:
            source = await self.core.calibrate(CalibrationCache(self.settings.local.state_dir / "calibration"),
                                               e.intra_op_threads, e.calibration_max_age_s)
            log.info("%s: batch cost model %s (%s)", self.stage, tuple(round(c, 5) for c in self.core.model.coef),
                     source)
        except Exception:
            log.exception("%s: calibration failed; starting from the prior cost model", self.stage)
        self.supervise("batches", lambda: self.core.run(lambda: self.should_stop))
        self.supervise("reports", self._report_forever)

    # -- outputs -------------------------------------------------------------------------

    def _answered(self, a: EncodeAnswer) -> None:
        """The core's answer to one job: its encoded part, back where the job came from."""
        span = Span(self.stage, a.job.sent_at_ms, *a.span).to_wire() if a.span is not None else None
        try:
            out = self._output(a.job, a.result, span)
        except Exception as exc:  # a bug must cost this part's answer, never leave its record open
            log.exception("%s: building the answer of %s part %d failed", self.stage, a.job.id, a.job.part)
            out = self._failed(a.job, WireError(ErrorCode.INTERNAL, f"{self.stage} failed: {exc!r}"), span)
        if isinstance(a.origin, Local):
            a.origin.send(out)
        else:
            self.io.deliver([out], [a.origin])

    def _modality(self, job: EncodeJob) -> str:
        """The part's modality (a generic pool, ``any``, serves several)."""
        return job.modality if self.modality == "any" else self.modality

    def _output(self, job: EncodeJob, result: Any, span: list[Any] | None) -> Out:
        if isinstance(result, Exception):
            err = result if isinstance(result, WireError) else WireError(ErrorCode.INTERNAL, f"{self.stage} failed: {result}")
            return self._failed(job, err, span)
        self.metrics.request_done(self.stage, "ok")
        out = result if isinstance(result, Encoded) else Encoded(result, {})
        part = EncodedPart(id=job.id, part=job.part, modality=self._modality(job), sent_at_ms=now_ms(),
                           embedding=to_wire(out.embedding, self.wire_dtype), extras=out.extras,
                           trace=job.trace + ([span] if span else []), chunk=job.chunk, cache=out.cache,
                           tenant=job.tenant, nonce=job.nonce, space=self.runner.identity or None)
        return out_map(self.names.encoded(job.lane), request_key(job.tenant, job.id), part.to_wire())

    def _failed(self, job: EncodeJob, err: WireError, span: list[Any] | None = None) -> Out:
        self.metrics.request_done(self.stage, "error", str(err.code))
        if err.field is None:  # say which part of the request it was
            err = WireError(err.code, err.message, f"parts.{job.part}", err.retry_after_ms)
        part = EncodedPart(id=job.id, part=job.part, modality=self._modality(job), sent_at_ms=now_ms(),
                           error=err.to_wire(), trace=job.trace + ([span] if span else []), chunk=job.chunk,
                           tenant=job.tenant, nonce=job.nonce)
        return out_map(self.names.encoded(job.lane), request_key(job.tenant, job.id), part.to_wire())

    # -- load reports --------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What this replica holds and what one more item costs it (see ``streams.policies.load``)."""
        core = self.core
        parts: dict[str, float] = {}
        lanes = {"rt": 0.0, "bulk": 0.0}
        tenants_rt: dict[str, float] = {}
        for lane, tenant, origin, ms in core.queued():
            lanes[lane] += ms
            if lane == "rt":
                tenants_rt[tenant] = tenants_rt.get(tenant, 0.0) + ms
            if isinstance(origin, Local):
                continue  # on no partition: the lane's total counts it
            key = f"{origin.topic}:{origin.partition}"
            parts[key] = parts.get(key, 0.0) + ms
        typical, unread = core.typical_ms(), 0
        for lane, topics in (("rt", self.rt_topics), ("bulk", self.bulk_topics)):
            backlog = sum(self.io.backlog(t) for t in topics)
            unread += backlog
            lanes[lane] += backlog * typical + core.preparing_ms[lane]
        in_service = core.in_service_ms()
        queued_rt = in_service + lanes["rt"]
        out = {"stage": self.stage, "at": now_ms(), "queued_ms": round(queued_rt + lanes["bulk"], 3),
               "queued_rt_ms": round(queued_rt, 3), "running_ms": round(in_service, 3),
               "items": core.held + unread,
               "partitions": {k: round(v, 3) for k, v in parts.items()},
               "assigned": sorted(f"{tp.topic}:{tp.partition}" for tp in self.io.assignment()),
               "item_ms": merge_item_costs(core.item_costs()), "wait_scale": round(core.wait_scale(), 3)}
        if core.fair:  # what each tenant's rt work is: a new rt item waits by fair order, not behind all of it
            out.update(tenant_shares(tenants_rt))
        return out

    async def _report_forever(self) -> None:
        prefix = self.settings.kafka.topic_prefix
        published_identity = False
        while not self.should_stop:
            await asyncio.sleep(REPORT_S)
            if not self.intake:  # no pool replica: the router sees its queue directly (placement)
                continue
            try:
                await load_reports.publish_load(self.redis, prefix, self.replica, self.report())
                if not published_identity and self.runner.identity:
                    await load_reports.publish_identity(self.redis, prefix, self.modality, self.runner.identity)
                    published_identity = True
            except Exception as exc:  # best effort: the router keeps its last numbers
                log.debug("%s: load report failed: %r", self.stage, exc)


class _Observer:
    """The core's reports as this stage's metrics."""

    def __init__(self, metrics: Metrics, stage: str, modality: Callable[[EncodeJob], str]) -> None:
        self.metrics, self.stage, self.modality = metrics, stage, modality

    def queue_depth(self, lane: str, depth: int) -> None:
        self.metrics.set_queue_depth(self.stage, lane, depth)

    def batch(self, answers: list[EncodeAnswer], started: float, finished: float) -> None:
        self.metrics.observe_batch(self.stage, len(answers))
        for a in answers:
            self.metrics.observe_span(self.stage, self.modality(a.job), a.job.lane, started - a.job.sent_at_ms,
                                      finished - started)
