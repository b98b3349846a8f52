"""The encoder stage: one modality's encode jobs in, one encoded part per job out, with the
engine kept busy.

Three hands work at once, so the engine never waits for I/O:

- the record loop (``handle``) decodes jobs, answers expired ones, and hands the rest to
- the prep thread, which fetches claim-checked bytes, does the CPU work before the model
  (tokenize, decode and resize) and asks the reuse cache (one MGET per polled batch): hits
  are answered at once, misses are queued by lane with their real cost (tokens);
- the engine thread, which runs the batch the pure ``MicroBatcher`` picks (rt first,
  length-aware, its budget in milliseconds predicted by a ``BatchCostModel`` that learns
  from every batch) from each lane's queue in tenant-fair order (``FairOrder``: tenants
  share engine time by predicted cost, so one tenant's backlog never holds another's
  items behind it). Its outputs are handed to the producer without waiting: the next
  batch starts while the broker acknowledges the last one; the job records are finished
  (committable) once their outputs are acknowledged.

A co-located router (``router.colocate``: this stage in the router's process) hands jobs
over with ``take_local`` instead of through the encode topic while this replica has room
(with ``router.colocate_pool`` off it takes only those, reads no topic and reports no load):
they skip a broker hop, are queued and batched like the rest, and their outputs go back
through the router's own producer (after the request's manifest, so the assembler sees the
parts of a request in order), which finishes the ingress record once every one of them is
with the broker.

Intake is bounded: past ``max_queue`` jobs held (preparing, queued or running) the stage's
topics are paused until it is back under three quarters of that, and no poll takes more than
the room left. Bulk jobs may hold at most half of it (``BULK_SHARE``): a flood of bulk
work cannot fill the stage and leave rt records waiting in the topic, where no fair order
reaches them. A few times a second the
stage reports its queued work (ms, per partition) and what one more item costs it, for the
router's admission (``streams.load``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import faust
from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob, request_key
from schemas.settings import Settings
from schemas.tensor import to_wire
from schemas.trace import Span, now_ms
from streams import costs
from streams.load import merge_item_costs, tenant_shares
from streams.metrics import Metrics
from streams.policies.batching import Batch, BatchLimits, MicroBatcher, Pending, Wait
from streams.policies.cost_model import BatchCostModel, Observation
from streams.policies.fair_order import FairOrder
from streams.policies.placement import Offer, take_local
from streams.produce import Out, out_map
from streams.runtime.stage import RecordStage
from workers import modalities
from workers.calibration import CalibrationCache
from workers.outputs import Encoded, EncoderRunner, Prepared
from workers.redisconn import connect_async

log = logging.getLogger(__name__)

REPORT_S = 0.25
BULK_SHARE = 0.5
"""Largest share of ``max_queue`` bulk jobs may hold; the rest is always rt's."""
MIN_BATCHING_GAIN = 0.1
TEXT_LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ROWS_ALONE_BATCH_MS = 10.0
"""Engine time one batch may take when the engine runs its rows alone: company saves such
an engine nothing, and every row's answer waits for the end of its batch, so its batches stay
short (a few short texts, a long one alone) and run in arrival order."""


@dataclass(frozen=True, slots=True)
class Local:
    """Where a job handed over in this process came from: no record of its own; its output
    goes back through ``send``."""

    lane: str
    send: Callable[[Out], None]


@dataclass(frozen=True, slots=True)
class Held:
    """A job between its record and its output."""

    prepared: Prepared
    record: ConsumerRecord | Local
    key: str | None
    """Its reuse-cache key (None: not cached)."""
    order: tuple[float, int] = (0.0, 0)
    """Its place in its lane's queue (``FairOrder.tag``)."""


class EncoderStage(RecordStage):
    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, modality: str, runner: EncoderRunner,
                 wire_dtype: str = "float16", group_id: str | None = None, intake: bool = True) -> None:
        names_prefix = settings.kafka.topic_prefix
        super().__init__(app, settings, [f"{names_prefix}.encode.{modality}.rt"], [f"{names_prefix}.encode.{modality}.bulk"],
                         group_id=group_id, intake=intake)
        e = settings.encoder
        self.stage = f"encode.{modality}"
        self.modality = modality
        self.metrics = metrics
        self.runner = runner
        self.wire_dtype = wire_dtype
        self.lengths = TEXT_LENGTHS if runner.variable_length else (1,)
        self.model = BatchCostModel(runner.cost_prior, max_batch_size=e.max_batch_size, max_batch_ms=e.max_batch_ms,
                                    rows_alone=runner.rows_alone)
        padded = runner.variable_length and not runner.rows_alone  # only padded batches gain from grouping
        self.batcher: MicroBatcher[Held] = MicroBatcher(
            BatchLimits(e.max_batch_size, e.max_wait_ms / 1000.0,
                        min(e.max_batch_ms, ROWS_ALONE_BATCH_MS) if runner.rows_alone else e.max_batch_ms,
                        grouping=e.grouping if padded else "fifo"),
            batch_cost=lambda cs: self.model.batch_ms(cs))
        self.max_wait_s = e.max_wait_ms / 1000.0
        self.fair = e.order == "fair"
        self.order: dict[str, FairOrder[Pending[Held]]] = {lane: FairOrder(key=_order_key) for lane in ("rt", "bulk")}
        self.queues: dict[str, list[Pending[Held]]] = {lane: o.items for lane, o in self.order.items()}
        self.held = 0
        self.held_bulk = 0
        self.max_queue = e.max_queue
        self.paused = False
        self.wake = asyncio.Event()
        self.engine = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{modality}")
        self.prep = ThreadPoolExecutor(1, thread_name_prefix=f"prep-{modality}")
        self.running_ms = 0.0
        self.direct_ms = 0.0
        """Predicted ms of the polled batch the engine thread prepares and runs directly (``_prepare``)."""
        self.preparing = 0
        """Polled batches on the prep thread now."""
        self.preparing_ms = {"rt": 0.0, "bulk": 0.0}
        """Predicted ms of the jobs being prepared, by lane (from their size, before tokenizing):
        work that is already this replica's, so placement and the load report count it."""
        self.replica = f"{self.stage}/{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.redis = connect_async(settings.redis.url, settings.redis.tls_ca, socket_timeout=0.2,
                                   socket_connect_timeout=0.2)

    # -- intake --------------------------------------------------------------------------

    async def handle(self, records: list[ConsumerRecord]) -> None:
        now = now_ms()
        jobs: list[tuple[EncodeJob, ConsumerRecord]] = []
        for r in records:
            try:
                job = EncodeJob.from_wire(unpack(r.value))
            except (DecodeError, ValueError, TypeError, RecursionError) as exc:
                self.metrics.to_dlq(self.stage)
                self.metrics.request_done(self.stage, "dlq")
                self.io.deliver([self.dlq(r, f"invalid_request: undecodable encode job: {exc}")], [r])
                continue
            if job.deadline_at_ms <= now:
                self.io.deliver([self._failed(job, _deadline_error())], [r])
                continue
            jobs.append((job, r))
        if not jobs:
            return
        self.held += len(jobs)
        self.held_bulk += sum(1 for _, r in jobs if self._lane(r) == "bulk")
        self._flow()
        self._prepare(jobs)
        self.io.hold(r for _, r in jobs)

    def take_local(self, offers: list[tuple[EncodeJob, float, Callable[[Out], None]]],
                   max_queued_ms: float, max_part_ms: float) -> list[bool]:
        """Jobs of a co-located router, each with its predicted ms and where its output goes:
        per job, whether this replica took it (else it goes through the encode topic). Taken
        while fewer than ``max_queue`` jobs are held, the predicted work queued ahead of it in
        its lane is at most ``max_queued_ms`` and its own at most ``max_part_ms``."""
        room = 0 if self.paused else self.max_queue - self.held
        taken = take_local([Offer(job.lane, ms) for job, ms, _ in offers], self.queued_ms("rt"),
                           self.queued_ms("bulk"), room, max_queued_ms, max_part_ms)
        jobs: list[tuple[EncodeJob, ConsumerRecord | Local]] = []
        now = now_ms()
        for (job, _, send), took in zip(offers, taken):
            if not took:
                continue
            if job.deadline_at_ms <= now:
                send(self._failed(job, _deadline_error()))
                continue
            jobs.append((job, Local("bulk" if job.lane == "bulk" else "rt", send)))
        if jobs:
            self.held += len(jobs)
            self.held_bulk += sum(1 for _, r in jobs if self._lane(r) == "bulk")
            self._flow()
            self._prepare(jobs)
        return taken

    def queued_ms(self, lane: str) -> float:
        """Predicted engine time ahead of a new job of ``lane``: the batch running, the rt
        queue, and for bulk the bulk queue too (rt goes first)."""
        lanes = ("rt",) if lane == "rt" else ("rt", "bulk")
        return (self.running_ms + self.direct_ms + sum(self.preparing_ms[q] for q in lanes)
                + sum(self.model.per_item_ms(p.cost) for q in lanes for p in self.queues[q]))

    def _prepare(self, jobs: list[tuple[EncodeJob, ConsumerRecord | Local]]) -> None:
        """Prep thread: bytes, preprocessing and the cache lookup for one polled batch, started
        at once (the thread works while the loop goes on). When the engine is idle, nothing
        is queued or being prepared and company would gain nothing, the engine thread does
        the preparing (claim-checked bytes included) and runs the jobs in the same call: two
        thread hand-offs fewer, which is most of what an idle stage adds to a request."""
        loop = asyncio.get_running_loop()
        direct = self._engine_idle()
        estimate = {"rt": 0.0, "bulk": 0.0}
        for job, record in jobs:
            estimate[self._lane(record)] += self.model.per_item_ms(self._length_before_prep(job))
        if direct:
            self.direct_ms = max(0.001, estimate["rt"] + estimate["bulk"])
            work = loop.run_in_executor(self.engine, self._prepare_and_run, [j for j, _ in jobs])
        else:
            self.preparing += 1
            for lane, ms in estimate.items():
                self.preparing_ms[lane] += ms
            work = loop.run_in_executor(self.prep, self.runner.prepare_many, [j for j, _ in jobs])
        asyncio.ensure_future(self._prepared(jobs, work, direct, estimate))

    def _length_before_prep(self, job: EncodeJob) -> float:
        """A job's length as its size says before it is prepared (tokens of a text, as the
        router prices it, capped at the longest length this engine runs)."""
        if not self.runner.variable_length:
            return 1.0
        spec = modalities.get(self._modality(job))
        size = len(job.text) if job.text is not None else len(job.data or b"")
        units = spec.units(size, self.settings.video.max_frames) if spec is not None else self.lengths[-1]
        return float(min(self.lengths[-1], max(1.0, units)))

    async def _prepared(self, jobs: list[tuple[EncodeJob, ConsumerRecord | Local]], work: asyncio.Future,
                        direct: bool, estimate: dict[str, float]) -> None:
        """Back on the loop: answer what needs no engine, queue the rest (or answer the batch
        the engine thread ran directly)."""
        ran: tuple[list[Any], list[float], float, float] | None = None
        try:
            if direct:
                try:
                    items, lookup, ran = await work
                finally:
                    self.direct_ms = 0.0
                ready = await self._looked_up(items, lookup)
            else:
                try:
                    ready = await work
                finally:
                    self.preparing -= 1
                    for lane, ms in estimate.items():
                        self.preparing_ms[lane] = max(0.0, self.preparing_ms[lane] - ms)
        except Exception as exc:  # the runner isolates items; this is a bug
            log.exception("%s: preparing %d jobs failed", self.stage, len(jobs))
            ready, ran = [exc] * len(jobs), None
        now, at = time.monotonic(), now_ms()
        done: list[Held] = []
        for (job, record), item in zip(jobs, ready):
            if isinstance(item, (Exception, Encoded)):  # refused, or a reuse-cache hit: answered here
                span = Span(self.stage, job.sent_at_ms, at, at).to_wire()
                self._answer_one(job, record, item, span)
            elif ran is not None:
                done.append(Held(item, record, item.key))
            else:
                self._enqueue(self._lane(record), item, record, now)
        if ran is not None and done:
            outputs, ran_lengths, started, finished = ran
            results = [o for o, item in zip(outputs, ready) if not isinstance(item, (Exception, Encoded))]
            self._answer_batch(done, results, started, finished, ran_lengths)
        for lane, q in self.queues.items():
            self.metrics.set_queue_depth(self.stage, lane, len(q))
        self.wake.set()

    def _lane(self, record: ConsumerRecord | Local) -> str:
        if isinstance(record, Local):
            return record.lane
        return "bulk" if record.topic in self.bulk_topics else "rt"

    def _enqueue(self, lane: str, item: Prepared, record: ConsumerRecord | Local, now: float) -> None:
        """Queue a prepared job at its place in its lane: by tenant and predicted cost
        (``encoder.order=fair``), or last (``arrival``)."""
        order = self.order[lane]
        tag = order.tag(item.job.tenant, self.model.per_item_ms(item.length)) if self.fair else order.tag("", 0.0)
        order.push(Pending(Held(item, record, item.key, tag), item.length, now))

    async def _looked_up(self, items: list[Any], lookup: Any) -> list[Any]:
        """What the cache lookup beside a direct run found (``items`` as they were when it
        failed: a cache failure only costs time)."""
        if lookup is None:
            return items
        try:
            return await asyncio.wrap_future(lookup)
        except Exception:  # the runner isolates cache trouble; this is a bug: answer what ran
            log.exception("%s: cache lookup failed", self.stage)
            return items

    def _engine_idle(self) -> bool:
        return (self.direct_ms == 0.0 and self.running_ms == 0.0 and self.preparing == 0
                and not self.queues["rt"] and not self.queues["bulk"] and self._wait_s() == 0.0)

    def _prepare_and_run(self, jobs: list[EncodeJob]) -> tuple[list[Any], Any, tuple[list[Any], list[float], float, float] | None]:
        """Engine thread, engine idle: prepare ``jobs`` and run them at once while the prep
        thread asks the reuse cache (a hit it finds wins; a miss claimed elsewhere is not
        waited for: it is computed here anyway). Returns per job its exception or
        ``Prepared``, the lookup's future (None: nothing to look up), and (per job the
        engine's output or None, the lengths run, started, finished)."""
        items = self.runner.prepare_items(jobs)
        todo = [i for i, item in enumerate(items) if not isinstance(item, Exception)]
        if not todo:
            return items, None, None
        lookup = self.prep.submit(self.runner.lookup, items, False)
        results, started, finished = self._timed_run([items[i] for i in todo])
        outputs: list[Any] = [None] * len(items)
        for i, r in zip(todo, results):
            outputs[i] = r
        return items, lookup, (outputs, [items[i].length for i in todo], started, finished)

    def _timed_run(self, items: list[Any]) -> tuple[list[Any], float, float]:
        """Engine thread: one engine call, timed where it runs (a batch queued behind another
        call on this thread is not charged for the wait); one output or exception per item."""
        started = now_ms()
        try:
            results = self.runner.run(items)
        except Exception as exc:  # the runner isolates items; this is a bug
            log.exception("%s: engine call failed", self.stage)
            results = [exc] * len(items)
        if len(results) != len(items):
            log.error("%s: engine returned %d outputs for %d inputs", self.stage, len(results), len(items))
            results = [RuntimeError("engine returned a wrong number of outputs")] * len(items)
        return results, started, now_ms()

    def _answer_one(self, job: EncodeJob, record: ConsumerRecord | Local, result: Any,
                    span: list[Any] | None = None) -> None:
        try:
            out = self._output(job, result, span)
        except Exception as exc:  # a bug must cost this part's answer, never leave its record open
            log.exception("%s: building the answer of %s part %d failed", self.stage, job.id, job.part)
            out = self._failed(job, WireError(ErrorCode.INTERNAL, f"{self.stage} failed: {exc!r}"), span)
        if isinstance(record, Local):
            record.send(out)
        else:
            self.io.deliver([out], [record])
        self.held -= 1
        if self._lane(record) == "bulk":
            self.held_bulk -= 1
        self._flow()

    def _flow(self) -> None:
        """Pause every input topic while too many jobs are held; resume under 3/4 of it."""
        if self.held >= self.max_queue or (self.paused and self.held >= self.max_queue * 3 // 4):
            self.paused = True  # paused again every time: a rebalance hands partitions back unpaused
            for t in (*self.rt_topics, *self.bulk_topics):
                self.io.pause(t)
        elif self.paused and self.held < self.max_queue * 3 // 4:
            self.paused = False
            for t in (*self.rt_topics, *self.bulk_topics):
                self.io.resume(t)
            self.bulk_paused = False  # the loop re-applies the rt-first gate

    def should_take_bulk(self) -> bool:
        return (not self.paused and self.held_bulk < self.max_queue * BULK_SHARE
                and self.backlog_rt() <= self.rt_backlog_records and not self.queues["rt"])

    def poll_budget(self) -> int | None:
        """No poll takes more than the room left (at least one: the topics are paused, not
        the poll, when it is full)."""
        return max(1, self.max_queue - self.held)

    # -- the engine ----------------------------------------------------------------------

    async def on_started(self) -> None:
        await super().on_started()
        loop = asyncio.get_running_loop()
        e, cache = self.settings.encoder, CalibrationCache(self.settings.local.state_dir / "calibration")
        try:
            timed = cache.load(self.runner.identity, e.intra_op_threads, e.calibration_max_age_s)
            source = "reused from this machine"
            if timed is None:
                timed = await loop.run_in_executor(self.engine, self.runner.calibrate)
                cache.store(self.runner.identity, e.intra_op_threads, timed)
                source = "timed"
            self.model.calibrate([Observation(int(n), length, ms) for n, length, ms in timed])
            log.info("%s: batch cost model %s (%s)", self.stage, tuple(round(c, 5) for c in self.model.coef), source)
        except Exception:
            log.exception("%s: calibration failed; starting from the prior cost model", self.stage)
        self.supervise("batches", self._batches_forever)
        self.supervise("reports", self._report_forever)

    async def _batches_forever(self) -> None:
        while not self.should_stop:
            decision = self.batcher.next_batch(self.queues["rt"], self.queues["bulk"], time.monotonic(),
                                               self._wait_s())
            if decision is None or isinstance(decision, Wait):
                self.wake.clear()
                timeout = None if decision is None else max(0.0, decision.until - time.monotonic())
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._run(decision)
            except Exception:
                log.exception("%s: batch failed", self.stage)

    def _wait_s(self) -> float:
        """How long an item waits for company: the setting, when the learned cost model says
        batches of the typical length are cheaper per item (by MIN_BATCHING_GAIN); else 0."""
        typical = self.lengths[len(self.lengths) // 2]
        return self.max_wait_s if self.model.batching_gain(typical) >= MIN_BATCHING_GAIN else 0.0

    async def _run(self, batch: Batch[Held]) -> None:
        chosen = {id(p) for p in batch.items}
        queue = self.queues[batch.lane]
        queue[:] = [p for p in queue if id(p) not in chosen]
        self.order[batch.lane].taken([p.item.order for p in batch.items])
        self.metrics.set_queue_depth(self.stage, batch.lane, len(queue))
        now = now_ms()
        live = [p.item for p in batch.items if p.item.prepared.job.deadline_at_ms > now]
        for p in batch.items:
            if p.item.prepared.job.deadline_at_ms <= now:
                self._answer_one(p.item.prepared.job, p.item.record, _deadline_error())
        if not live:
            return
        self.running_ms = max(0.001, self.model.batch_ms([h.prepared.length for h in live]))
        try:
            results, started, finished = await asyncio.get_running_loop().run_in_executor(
                self.engine, self._timed_run, [h.prepared for h in live])
        except Exception as exc:  # the executor itself failed; a bug
            log.exception("%s: engine call failed", self.stage)
            results, started, finished = [exc] * len(live), now_ms(), now_ms()
        finally:
            self.running_ms = 0.0
        self._answer_batch(live, results, started, finished)

    def _answer_batch(self, live: list[Held], results: list[Any], started: float, finished: float,
                      ran_lengths: list[float] | None = None) -> None:
        """Account for one engine run (metrics, the cost model) and answer its jobs
        (``ran_lengths``: what the engine ran, when more than ``live``)."""
        writes = []
        for h, r in zip(live, results):
            job = h.prepared.job
            if isinstance(r, Encoded) and h.key is not None:
                writes.append((h.key, r))
                r = Encoded(r.embedding, r.extras, cache="miss")
            self._answer_one(job, h.record, r, Span(self.stage, job.sent_at_ms, started, finished).to_wire())
        try:  # after the answers: accounting must never cost them
            self.metrics.observe_batch(self.stage, len(live))
            self.model.observe_batch([h.prepared.length for h in live] if ran_lengths is None else ran_lengths,
                                     finished - started)
            for h in live:
                job = h.prepared.job
                self.metrics.observe_span(self.stage, self._modality(job), job.lane, started - job.sent_at_ms,
                                          finished - started)
        except Exception:
            log.exception("%s: accounting for a batch of %d failed", self.stage, len(live))
        if writes:
            asyncio.get_running_loop().run_in_executor(self.prep, self.runner.store, writes)

    # -- outputs -------------------------------------------------------------------------

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
                           tenant=job.tenant, nonce=job.nonce)
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
        """What this replica holds and what one more item costs it (see ``streams.load``)."""
        parts: dict[str, float] = {}
        lanes = {"rt": 0.0, "bulk": 0.0}
        tenants_rt: dict[str, float] = {}
        for lane, q in self.queues.items():
            for p in q:
                ms = self.model.per_item_ms(p.cost)
                lanes[lane] += ms
                if lane == "rt":
                    tenant = p.item.prepared.job.tenant
                    tenants_rt[tenant] = tenants_rt.get(tenant, 0.0) + ms
                if isinstance(p.item.record, Local):
                    continue  # on no partition: the lane's total counts it
                key = f"{p.item.record.topic}:{p.item.record.partition}"
                parts[key] = parts.get(key, 0.0) + ms
        typical = self.model.per_item_ms(self.lengths[len(self.lengths) // 2])
        for lane, topics in (("rt", self.rt_topics), ("bulk", self.bulk_topics)):
            lanes[lane] += sum(self.io.backlog(t) for t in topics) * typical
        lanes["rt"] += self.preparing_ms["rt"]
        lanes["bulk"] += self.preparing_ms["bulk"]
        queued_rt = self.running_ms + self.direct_ms + lanes["rt"]
        out = {"stage": self.stage, "at": now_ms(), "queued_ms": round(queued_rt + lanes["bulk"], 3),
               "queued_rt_ms": round(queued_rt, 3),
               "partitions": {k: round(v, 3) for k, v in parts.items()},
               "assigned": sorted(f"{tp.topic}:{tp.partition}" for tp in self.io.assignment()),
               "item_ms": merge_item_costs((length, self.model.per_item_ms(length)) for length in self.lengths)}
        if self.fair:  # what each tenant's rt work is: a new rt item waits by fair order, not behind all of it
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
                await costs.publish_load(self.redis, prefix, self.replica, self.report())
                if not published_identity and self.runner.identity:
                    await costs.publish_identity(self.redis, prefix, self.modality, self.runner.identity)
                    published_identity = True
            except Exception as exc:  # best effort: the router keeps its last numbers
                log.debug("%s: load report failed: %r", self.stage, exc)


def _order_key(p: Pending[Held]) -> tuple[float, int]:
    return p.item.order


def _deadline_error() -> WireError:
    return WireError(ErrorCode.DEADLINE_EXCEEDED, "the part reached its encoder after the request's deadline")
