"""The generator stage: assembled generate jobs in, tokens and one terminal event out.

One engine, one step loop (vLLM-style: schedule -> execute -> update). Intake agents only
turn jobs into sequences and hand them to the scheduler (without acknowledging them); the
loop runs each step in the engine thread, streams new text as ``token`` events in order,
and on a sequence's end sends its ``result`` (or ``error``) event and only then
acknowledges the job — so a crash repeats a generation (the SDK shows each (kind, seq)
once) but never loses one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import faust

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import GenerateJob, request_key
from schemas.settings import Settings
from schemas.trace import now_ms
from streams.app import topic_names
from streams.metrics import Metrics
from streams.policies.scheduler import (
    ContinuousBatchScheduler,
    SchedulerLimits,
    SequenceRequest,
    StaticBatchScheduler,
    StepOutput,
)
from streams.produce import Out, out_map
from streams.runtime.recovery import done_marker, recover
from streams.runtime.stage import RecordStage
from workers import modalities
from workers import prompt as P
from workers.engines import EngineOptions, load_engine
from workers.engines.lm import LMError, SamplingParams, StopChecker, execute_step
from workers.prefix_cache import PrefixCache
from workers.repository import ModelRepository

log = logging.getLogger(__name__)
STAGE = "generate"


def prompt_parts(parts: list[dict[str, Any]]) -> list[Any]:
    """The prompt builder's parts from what the assembler forwarded (schemas.jobs.GenerateJob),
    each made by its modality's ``prompt_part``; parts of a modality without one (or not
    registered here) are left out."""
    out: list[Any] = []
    for p in parts:
        spec = modalities.get(str(p.get("modality")))
        if spec is not None and spec.prompt_part is not None:
            out.append(spec.prompt_part(p))
    return out


@dataclass
class Active:
    job: GenerateJob
    record: ConsumerRecord
    seq: Any
    started_ms: float
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    sent_text: str = ""
    next_seq: int = 1  # 0 was the router's `accepted`
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    token_times: list[float] = field(default_factory=list)


class GeneratorStage(RecordStage):
    """Generate jobs in; token events and one terminal event per job out, exactly once.

    A job's record is finished when its terminal event and done marker are with the broker,
    in whatever order generations end (the commit point waits for the oldest unfinished one).
    Taking over a partition, it reads the done markers and the events already sent for the
    jobs it will replay (``streams.runtime.recovery``): a job marked done is dropped; a job
    cut off midway is generated again (greedy fp32 decoding gives the same tokens) and only
    the token events not yet on the reply topic are sent.

    Bounded: it holds at most ``max_queued`` jobs (each poll takes only the room left, and
    the topics pause while it is full); finished ids are remembered ``done_retention_ms``.
    The step loop survives its own errors: a step that fails fails its sequences; anything
    else that raises is logged and the loop is started again (``RecordStage.supervise``).
    """

    stage = STAGE

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, engine: Any, tokenizer: Any,
                 scheduler: Any, stops: Any) -> None:
        names = topic_names(settings)
        super().__init__(app, settings, [names.generate("rt")], [names.generate("bulk")])
        self.metrics = metrics
        self.engine, self.tokenizer, self.scheduler, self.stops = engine, tokenizer, scheduler, stops
        self.active: dict[str, Active] = {}
        self.done: dict[str, float] = {}
        self.sent: dict[str, set[tuple[str, int]]] = {}
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-lm")
        self.every = max(1, settings.generator.stream_every_tokens)
        self.cross_tenant = settings.cache.cross_tenant
        self.max_active = settings.generator.max_queued
        self.done_retention_ms = float(settings.generator.done_retention_ms)
        self.stepping = False
        """A step runs in the engine thread now: sequences it holds are released after it."""
        self.release_later: list[Any] = []

    # -- intake --------------------------------------------------------------------------

    async def handle(self, records: list[ConsumerRecord]) -> None:
        for r in records:
            self._admit(r)
        self._note_state()
        self.wake.set()

    def _admit(self, r: ConsumerRecord) -> None:
        try:
            job = GenerateJob.from_wire(unpack(r.value))
        except (DecodeError, ValueError, TypeError, RecursionError) as exc:
            self.metrics.to_dlq(STAGE)
            self.io.deliver([self.dlq(r, f"invalid_request: undecodable generate job: {exc}")], [r])
            return
        key = request_key(job.tenant, job.id)  # a tenant's id is its own: another tenant's is another job
        if key in self.active or key in self.done:  # a repeat of a job running or answered
            if key in self.done:
                self.sent.pop(key, None)
            self.io.finish([r])
            return
        now = now_ms()
        if job.deadline_at_ms <= now:
            self._fail(job, r, WireError(ErrorCode.DEADLINE_EXCEEDED, "the request reached the generator after its deadline"))
            return
        params = job.params or {}
        try:
            text = P.render_chatml(P.build_messages(prompt_parts(job.parts), P.PromptSettings()))
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            sampling = SamplingParams(max_tokens=int(params.get("max_tokens", 64)),
                                      temperature=float(params.get("temperature", 0.0)),
                                      stop=tuple(params.get("stop") or ()))
            seq = self.engine.new_sequence(key, ids, sampling, cache_scope=self.cache_scope(job))
        except (LMError, ValueError, TypeError) as exc:
            self._fail(job, r, WireError(ErrorCode.INVALID_REQUEST, str(exc)))
            return
        self.active[key] = Active(job, r, seq, now, cached_tokens=seq.num_cached)
        deadline = time.monotonic() + (job.deadline_at_ms - now) / 1000.0
        self.scheduler.add(SequenceRequest(key, len(ids), sampling.max_tokens, job.lane, arrived_at=time.monotonic(),
                                           deadline=deadline, num_cached_tokens=seq.num_cached))

    def cache_scope(self, job: GenerateJob) -> str:
        """Whose prompt prefixes ``job`` may reuse: its tenant's only (a hit shows in the
        result's cached tokens), unless the deployment shares caches across tenants."""
        return "" if self.cross_tenant else job.tenant

    def _note_state(self) -> None:
        self.metrics.set_state(STAGE, active=len(self.active), done=len(self.done))

    def poll_budget(self) -> int:
        """Bounded intake: at ``max_queued`` jobs held the runtime pauses the stage's topics."""
        return max(0, self.max_active - len(self.active))

    # -- the step loop -------------------------------------------------------------------

    async def on_started(self) -> None:
        await super().on_started()
        self.supervise("steps", self._steps_forever)

    async def _steps_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.should_stop:
            if not self.scheduler.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            out = self.scheduler.schedule(time.monotonic())
            self.stepping = True
            try:
                step = await loop.run_in_executor(self.executor, execute_step, self.engine, out.plan,
                                                  {k: a.seq for k, a in self.active.items()}, self.stops)
            except Exception as exc:  # a failed step fails the sequences in it, not the stage
                log.exception("generate: step failed")
                failed = set(out.decode) | {c.seq_id for c in out.prefill}
                for seq_id in failed:
                    self.scheduler.abort(seq_id, time.monotonic())
                # The step owed these tokens; their sequences are aborted, so none is used.
                owed = set(out.decode) | {c.seq_id for c in out.prefill if c.is_last}
                self.scheduler.update(StepOutput(tokens={seq_id: 0 for seq_id in owed}))
                self._released_after_step()
                for seq_id in failed:
                    a = self.active.pop(seq_id, None)
                    if a:
                        self.engine.release(a.seq)
                        self._fail(a.job, a.record, WireError(ErrorCode.INTERNAL, f"generation failed: {exc!r}"), a)
                continue
            self._released_after_step()
            finished = self.scheduler.update(step)
            self._stream(step.tokens, {f.seq_id for f in finished})
            for fin in finished:
                self._finish(fin)
            self._note_state()

    def _stream(self, tokens: dict[str, int], ending: set[str]) -> None:
        outs: list[Out] = []
        now = now_ms()
        for seq_id in tokens:
            a = self.active.get(seq_id)
            if a is None:
                continue
            a.token_times.append(now)
            delta = a.seq.text[len(a.sent_text):] if a.seq.text.startswith(a.sent_text) else a.seq.text
            due = len(a.token_times) % self.every == 0 or seq_id in ending
            if delta and due:
                ev = Event(a.job.id, EventKind.TOKEN, a.next_seq, now,
                           payload={"text": delta, "tokens": len(a.seq.generated)})
                if ("token", a.next_seq) not in self.sent.get(seq_id, ()):  # not sent before a takeover
                    outs.append(out_map(a.job.reply_to, a.job.id, ev.to_wire()))
                a.next_seq += 1
                a.sent_text = a.seq.text
                if a.first_token_ms is None:
                    a.first_token_ms = now
        if outs:
            self.io.deliver(outs)

    def _finish(self, fin: Any) -> None:
        a = self.active.pop(fin.seq_id, None)
        if a is None:
            return
        self.engine.release(a.seq)
        job, now = a.job, now_ms()
        if fin.reason in ("deadline_exceeded", "aborted"):
            code = ErrorCode.DEADLINE_EXCEEDED if fin.reason == "deadline_exceeded" else ErrorCode.INTERNAL
            self._fail(job, a.record, WireError(code, f"generation ended: {fin.reason}"), a)
            return
        n = len(a.token_times)
        ttft = (a.first_token_ms or now) - job.accepted_at_ms
        tpot = (a.token_times[-1] - a.token_times[0]) / (n - 1) if n > 1 else None
        timings = self._timings(job, a, now)
        timings.update(ttft_ms=round(ttft, 3), tpot_ms=round(tpot, 3) if tpot is not None else None)
        ev = Event(job.id, EventKind.RESULT, a.next_seq, now, timings=timings, payload={
            "task": "generate", "text": a.seq.text, "finish_reason": fin.reason,
            "tokens": {"prompt": a.seq.prompt_len, "completion": len(fin.tokens), "cached": a.cached_tokens},
            "parts": job.parts})
        self._terminal(job, a.record, ev)
        self.metrics.request_done(STAGE, "ok")
        self.metrics.observe_e2e("generate", job.lane, timings["e2e_ms"])
        self.metrics.observe_ttft(job.lane, ttft)
        if tpot is not None:
            self.metrics.observe_tpot(job.lane, tpot)

    def _timings(self, job: GenerateJob, a: Active | None, now: float) -> dict[str, Any]:
        stages = list(job.trace)
        started = a.started_ms if a else now
        stages.append({"stage": STAGE, "queued_ms": round(max(0.0, started - job.sent_at_ms), 3),
                       "service_ms": round(now - started, 3)})
        return {"e2e_ms": round(now - job.client_sent_at_ms, 3), "accepted_at_ms": job.accepted_at_ms,
                "stages": stages}

    def _fail(self, job: GenerateJob, record: ConsumerRecord, err: WireError, a: Active | None = None) -> None:
        seq = a.next_seq if a else 1
        ev = Event(job.id, EventKind.ERROR, seq, now_ms(), error=err.to_wire(), timings=self._timings(job, a, now_ms()))
        self._terminal(job, record, ev)
        self.metrics.request_done(STAGE, "error", str(err.code))

    def _terminal(self, job: GenerateJob, record: ConsumerRecord, ev: Event) -> None:
        """The job's last event and its done marker; the job record is finished with them."""
        key = request_key(job.tenant, job.id)
        outs = [] if ("terminal", ev.seq) in self.sent.pop(key, set()) else [out_map(job.reply_to, job.id, ev.to_wire())]
        outs.append(done_marker(self.names.generator_done, key, job.reply_to, now_ms()))
        self.io.deliver(outs, [record])
        now = now_ms()
        self.done[key] = now
        self._prune_done(now)

    def _prune_done(self, now: float) -> None:
        """Forget generations finished over ``done_retention_ms`` ago (oldest first)."""
        cutoff = now - self.done_retention_ms
        while self.done:
            key, at = next(iter(self.done.items()))
            if at >= cutoff:
                break
            del self.done[key]

    def on_failed_output(self, out: Out, exc: BaseException) -> Out | None:
        """An event the reply topic refuses (too large for it, topic gone): the client gets a
        short error event in its place if that fits; the stage goes on either way."""
        if out.topic in (self.names.dlq, self.names.generator_done) or out.key is None:
            return super().on_failed_output(out, exc)
        err = WireError(ErrorCode.INTERNAL, f"the answer could not be written to {out.topic}: {type(exc).__name__}")
        try:
            kind = unpack(out.value).get("kind")
        except Exception:
            kind = None
        if kind not in ("result", "error"):
            return None  # a token event: the result still carries the whole text
        ev = Event(out.key.decode(), EventKind.ERROR, 10**6, now_ms(), error=err.to_wire())
        return out_map(out.topic, out.key, ev.to_wire())

    # -- ownership -----------------------------------------------------------------------

    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        assert self.io.consumer is not None
        k = self.settings.kafka
        try:
            found = await recover(self.io.consumer, k.bootstrap, self.io.settings.client_kwargs, k.max_message_bytes,
                                  self.names.generator_done, tps, _opens, now_ms(), self.done_retention_ms)
        except Exception:
            log.exception("generate: recovery of %s failed; replayed generations may repeat events", tps)
            return
        for done in found.done.values():
            self.done.update(done)
        self.sent.update(found.sent)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        """Generations of revoked partitions stop here, unanswered; the next owner runs them
        again. A step in the engine thread may still hold their KV: released after it."""
        gone = {(tp.topic, tp.partition) for tp in tps}
        for seq_id, a in list(self.active.items()):
            if (a.record.topic, a.record.partition) in gone:
                self.scheduler.abort(seq_id, time.monotonic())
                self.active.pop(seq_id)
                self.release_later.append(a.seq)
        if not self.stepping:
            self._released_after_step()

    def _released_after_step(self) -> None:
        self.stepping = False
        while self.release_later:
            self.engine.release(self.release_later.pop())

    async def idle(self) -> None:
        self._prune_done(now_ms())
        self.metrics.set_state(STAGE, active=len(self.active), done=len(self.done))


def _opens(rec: ConsumerRecord) -> tuple[str, str, str] | None:
    job = GenerateJob.from_wire(unpack(rec.value))
    return request_key(job.tenant, job.id), job.reply_to, job.id


def install_generator(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    import tokenizers


    g = settings.generator
    config = ModelRepository(settings.models.repository).resolve(settings.models.lm_model)
    engine = load_engine(config, g.precision, EngineOptions.from_settings(settings.encoder),
                         stage=STAGE, observer=metrics)
    info = engine.info
    if g.prefix_cache_mb > 0:  # keyed by the variant that actually serves
        engine.prefix_cache = PrefixCache(g.prefix_cache_mb * 1024 * 1024, 16,
                                          f"{info.model}/{info.version}/{info.precision}")
    metrics.set_engine(STAGE, dataclasses.asdict(info))
    tokenizer = tokenizers.Tokenizer.from_file(str(config.tokenizer_path))
    engine.warmup()
    limits = SchedulerLimits(g.max_tokens_per_step, g.max_running, g.max_prefill_chunk)
    cls = StaticBatchScheduler if g.scheduler == "static" else ContinuousBatchScheduler
    scheduler = cls(limits, engine.eos_token_ids)
    log.info("generate: %s/%s %s on %s, %s batching, prefix cache %s", info.model, info.version, info.precision,
             info.provider, g.scheduler, "on" if engine.prefix_cache else "off")
    GeneratorStage(app, settings, metrics, engine, tokenizer, scheduler, StopChecker(tokenizer, engine.eos_token_ids)).install()
