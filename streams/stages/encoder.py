"""The encoder stage: consume one modality's encode topics (rt and bulk), micro-batch,
run the engine off the event loop, and send one encoded part per job to the assembler.

Intake agents only queue jobs (bounded, and without acknowledging them); one batching
loop asks the pure ``MicroBatcher`` what to run next, runs it in a single engine thread so
the consumer keeps polling and heartbeating while a batch runs, sends the outputs, and only
then acknowledges the inputs. A crash therefore repeats jobs (the assembler ignores
duplicates) but never loses one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import faust
import numpy as np

from schemas.codec import ERROR_HEADER, DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob
from schemas.settings import Settings
from schemas.tensor import to_wire
from schemas.trace import Span, now_ms
from streams import costs
from streams.app import raw_topic, topic_names
from streams.metrics import Metrics
from streams.policies.batching import Batch, BatchLimits, MicroBatcher, Pending, Wait
from streams.produce import Out, out_map, send_all
from streams.topics import LANES
from workers.outputs import Encoded

log = logging.getLogger(__name__)

SEND_RETRY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
COST_PUBLISH_S = 2.0


@dataclass(frozen=True, slots=True)
class Job:
    job: EncodeJob
    event: Any


# run_batch(items) -> one output (or the item's exception) per item, in order.
BatchFn = Callable[[Sequence[EncodeJob]], list["Encoded | np.ndarray | Exception"]]


class EncoderLoop:
    """The batching loop of one encoder worker (any modality)."""

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, modality: str, run_batch: BatchFn,
                 cost: Callable[[EncodeJob], float], wire_dtype: str = "float16") -> None:
        e = settings.encoder
        self.app = app
        self.metrics = metrics
        self.names = topic_names(settings)
        self.modality = modality
        self.stage = f"encode.{modality}"
        self.run_batch = run_batch
        self.cost = cost
        self.wire_dtype = wire_dtype
        self.batcher: MicroBatcher[Job] = MicroBatcher(
            BatchLimits(e.max_batch_size, e.max_wait_ms / 1000.0, float(e.max_batch_tokens)))
        self.queues: dict[str, deque[Pending[Job]]] = {str(lane): deque() for lane in LANES}
        self.space = asyncio.Semaphore(e.max_queue)
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{modality}")
        self.cost_observer = costs.CostObserver()
        self.identity = ""
        """name/version/precision/preprocessing of the model, published for the result cache."""
        self.redis_url = settings.redis.url
        self._redis: Any = None

    def install(self) -> None:
        for lane in LANES:
            self._install_intake(str(lane))

        @self.app.task
        async def batches() -> None:
            await self.run_forever()

        @self.app.timer(COST_PUBLISH_S, name=f"costs-{self.modality}")
        async def publish_costs() -> None:
            if self._redis is None:
                import redis.asyncio

                self._redis = redis.asyncio.Redis.from_url(self.redis_url, socket_timeout=0.2,
                                                           socket_connect_timeout=0.2)
            await costs.publish(self._redis, self.names.prefix, self.modality, self.cost_observer)
            if self.identity:
                await costs.publish_identity(self._redis, self.names.prefix, self.modality, self.identity)

    def _install_intake(self, lane: str) -> None:
        topic = raw_topic(self.app, self.names.encode(self.modality, lane))

        @self.app.agent(topic, name=f"intake-{self.modality}-{lane}")
        async def intake(stream: Any) -> None:
            async for event in stream.noack().events():
                await self.space.acquire()
                try:
                    await self._admit(event, lane)
                except Exception:
                    log.exception("%s: intake failed on offset %s", self.stage, event.message.offset)
                    self.space.release()
                    event.ack()

    async def _admit(self, event: Any, lane: str) -> None:
        try:
            job = EncodeJob.from_wire(unpack(event.value))
        except (DecodeError, ValueError) as exc:
            self.metrics.to_dlq(self.stage)
            self.metrics.request_done(self.stage, "dlq")
            await self._finish([Out(self.names.dlq, event.key, bytes(event.value or b""),
                                    [(ERROR_HEADER, f"undecodable encode job: {exc}".encode()[:1000])])], [event])
            return
        if job.deadline_at_ms <= now_ms():
            await self._finish([self._failed(job, _deadline_error())], [event])
            return
        self.queues[lane].append(Pending(Job(job, event), self.cost(job), time.monotonic()))
        self.metrics.set_queue_depth(self.stage, lane, len(self.queues[lane]))
        self.wake.set()

    async def run_forever(self) -> None:
        while True:
            decision = self.batcher.next_batch(self.queues["rt"], self.queues["bulk"], time.monotonic())
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

    async def _run(self, batch: Batch[Job]) -> None:
        queue = self.queues[batch.lane]
        for _ in batch.items:
            queue.popleft()
        self.metrics.set_queue_depth(self.stage, batch.lane, len(queue))
        now = now_ms()
        live = [p.item for p in batch.items if p.item.job.deadline_at_ms > now]
        outs = [self._failed(p.item.job, _deadline_error()) for p in batch.items if p.item.job.deadline_at_ms <= now]
        if live:
            started = now_ms()
            loop = asyncio.get_running_loop()
            try:
                results = await loop.run_in_executor(self.executor, self.run_batch, [j.job for j in live])
            except Exception as exc:  # the batch function isolates items; this is a bug
                log.exception("%s: engine call failed", self.stage)
                results = [exc] * len(live)
            finished = now_ms()
            if len(results) != len(live):
                log.error("%s: engine returned %d outputs for %d inputs", self.stage, len(results), len(live))
                results = [RuntimeError("engine returned a wrong number of outputs")] * len(live)
            self.metrics.observe_batch(self.stage, len(live))
            self.cost_observer.observe(sum(self.cost(j.job) for j in live), finished - started)
            for j, r in zip(live, results):
                span = Span(self.stage, j.job.sent_at_ms, started, finished).to_wire()
                self.metrics.observe_span(self.stage, self._modality(j.job), j.job.lane, started - j.job.sent_at_ms,
                                          finished - started)
                if isinstance(r, Exception):
                    err = r if isinstance(r, WireError) else WireError(ErrorCode.INTERNAL, f"{self.stage} failed: {r}")
                    outs.append(self._failed(j.job, err, span))
                else:
                    self.metrics.request_done(self.stage, "ok")
                    out = r if isinstance(r, Encoded) else Encoded(r, {})
                    outs.append(out_map(self.names.encoded(j.job.lane), j.job.id, EncodedPart(
                        id=j.job.id, part=j.job.part, modality=self._modality(j.job), sent_at_ms=now_ms(),
                        embedding=to_wire(out.embedding, self.wire_dtype), extras=out.extras,
                        trace=j.job.trace + [span], chunk=j.job.chunk, cache=out.cache).to_wire()))
        await self._finish(outs, [p.item.event for p in batch.items])

    def _modality(self, job: EncodeJob) -> str:
        """The part's modality (a generic pool, ``any``, serves several)."""
        return job.modality if self.modality == "any" else self.modality

    def _failed(self, job: EncodeJob, err: WireError, span: list[Any] | None = None) -> Out:
        self.metrics.request_done(self.stage, "error", str(err.code))
        if err.field is None:  # say which part of the request it was
            err = WireError(err.code, err.message, f"parts.{job.part}", err.retry_after_ms)
        part = EncodedPart(id=job.id, part=job.part, modality=self._modality(job), sent_at_ms=now_ms(),
                           error=err.to_wire(), trace=job.trace + ([span] if span else []), chunk=job.chunk)
        return out_map(self.names.encoded(job.lane), job.id, part.to_wire())

    async def _finish(self, outs: list[Out], events: list[Any]) -> None:
        """Deliver outputs, then acknowledge their inputs and free their queue slots."""
        for delay in (*SEND_RETRY_S, None):
            try:
                await send_all(self.app.producer, outs)
                break
            except Exception as exc:
                if delay is None:
                    # Leave the inputs unacknowledged: they are delivered again after a
                    # restart or rebalance rather than lost.
                    log.error("%s: could not deliver %d outputs, leaving inputs for redelivery: %r",
                              self.stage, len(outs), exc)
                    for _ in events:
                        self.space.release()
                    return
                log.warning("%s: send failed (%r); retrying in %.1fs", self.stage, exc, delay)
                await asyncio.sleep(delay)
        for ev in events:
            ev.ack()
            self.space.release()


def _deadline_error() -> WireError:
    return WireError(ErrorCode.DEADLINE_EXCEEDED, "the part reached its encoder after the request's deadline")
