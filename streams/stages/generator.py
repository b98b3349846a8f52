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

from schemas.codec import ERROR_HEADER, DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import GenerateJob
from schemas.settings import Settings
from schemas.trace import now_ms
from streams.app import raw_topic, topic_names
from streams.metrics import Metrics
from streams.policies.scheduler import (
    ContinuousBatchScheduler,
    SchedulerLimits,
    SequenceRequest,
    StaticBatchScheduler,
    StepOutput,
)
from streams.produce import Out, out_map, send_all
from streams.topics import LANES
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
    event: Any
    seq: Any
    started_ms: float
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    sent_text: str = ""
    next_seq: int = 1  # 0 was the router's `accepted`
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    token_times: list[float] = field(default_factory=list)


class GeneratorLoop:
    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, engine: Any, tokenizer: Any,
                 scheduler: Any, stops: Any) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics
        self.names = topic_names(settings)
        self.engine, self.tokenizer, self.scheduler, self.stops = engine, tokenizer, scheduler, stops
        self.active: dict[str, Active] = {}
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-lm")
        self.every = max(1, settings.generator.stream_every_tokens)

    def install(self) -> None:
        for lane in LANES:
            self._install_intake(str(lane))

        @self.app.task
        async def steps() -> None:
            await self.run_forever()

    def _install_intake(self, lane: str) -> None:
        topic = raw_topic(self.app, self.names.generate(lane))

        @self.app.agent(topic, name=f"intake-generate-{lane}")
        async def intake(stream: Any) -> None:
            async for event in stream.noack().events():
                try:
                    await self._admit(event)
                except Exception:
                    log.exception("generate: intake failed on offset %s", event.message.offset)
                    event.ack()

    async def _admit(self, event: Any) -> None:
        try:
            job = GenerateJob.from_wire(unpack(event.value))
        except (DecodeError, ValueError) as exc:
            self.metrics.to_dlq(STAGE)
            await send_all(self.app.producer, [Out(self.names.dlq, event.key, bytes(event.value or b""),
                                                   [(ERROR_HEADER, f"undecodable generate job: {exc}".encode()[:1000])])])
            event.ack()
            return
        if job.id in self.active:  # a redelivery of a job that is still running
            event.ack()
            return
        now = now_ms()
        if job.deadline_at_ms <= now:
            await self._fail(job, event, WireError(ErrorCode.DEADLINE_EXCEEDED, "the request reached the generator after its deadline"))
            return
        params = job.params or {}
        try:
            text = P.render_chatml(P.build_messages(prompt_parts(job.parts), P.PromptSettings()))
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            sampling = SamplingParams(max_tokens=int(params.get("max_tokens", 64)),
                                      temperature=float(params.get("temperature", 0.0)),
                                      stop=tuple(params.get("stop") or ()))
            seq = self.engine.new_sequence(job.id, ids, sampling)
        except (LMError, ValueError) as exc:
            await self._fail(job, event, WireError(ErrorCode.INVALID_REQUEST, str(exc)))
            return
        self.active[job.id] = Active(job, event, seq, now, cached_tokens=seq.num_cached)
        deadline = time.monotonic() + (job.deadline_at_ms - now) / 1000.0
        self.scheduler.add(SequenceRequest(job.id, len(ids), sampling.max_tokens, job.lane, arrived_at=time.monotonic(),
                                           deadline=deadline, num_cached_tokens=seq.num_cached))
        self.wake.set()

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            out = self.scheduler.schedule(time.monotonic())
            try:
                step = await loop.run_in_executor(self.executor, execute_step, self.engine, out.plan,
                                                  {k: a.seq for k, a in self.active.items()}, self.stops)
            except Exception as exc:  # a failed step fails the sequences in it, not the stage
                log.exception("generate: step failed")
                step = None
                failed = set(out.decode) | {c.seq_id for c in out.prefill}
                for seq_id in failed:
                    self.scheduler.abort(seq_id, time.monotonic())
                self.scheduler.update(StepOutput(tokens={}))
                for seq_id in failed:
                    a = self.active.pop(seq_id, None)
                    if a:
                        self.engine.release(a.seq)
                        await self._fail(a.job, a.event, WireError(ErrorCode.INTERNAL, f"generation failed: {exc!r}"))
                continue
            finished = self.scheduler.update(step)
            await self._stream(step.tokens, {f.seq_id for f in finished})
            for fin in finished:
                await self._finish(fin)

    async def _stream(self, tokens: dict[str, int], ending: set[str]) -> None:
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
                outs.append(out_map(a.job.reply_to, a.job.id, ev.to_wire()))
                a.next_seq += 1
                a.sent_text = a.seq.text
                if a.first_token_ms is None:
                    a.first_token_ms = now
        if outs:
            await send_all(self.app.producer, outs)

    async def _finish(self, fin: Any) -> None:
        a = self.active.pop(fin.seq_id, None)
        if a is None:
            return
        self.engine.release(a.seq)
        job, now = a.job, now_ms()
        if fin.reason in ("deadline_exceeded", "aborted"):
            code = ErrorCode.DEADLINE_EXCEEDED if fin.reason == "deadline_exceeded" else ErrorCode.INTERNAL
            await self._fail(job, a.event, WireError(code, f"generation ended: {fin.reason}"), a)
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
        await send_all(self.app.producer, [out_map(job.reply_to, job.id, ev.to_wire())])
        a.event.ack()
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

    async def _fail(self, job: GenerateJob, event: Any, err: WireError, a: Active | None = None) -> None:
        seq = a.next_seq if a else 1
        ev = Event(job.id, EventKind.ERROR, seq, now_ms(), error=err.to_wire(), timings=self._timings(job, a, now_ms()))
        await send_all(self.app.producer, [out_map(job.reply_to, job.id, ev.to_wire())])
        event.ack()
        self.metrics.request_done(STAGE, "error", str(err.code))


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
    GeneratorLoop(app, settings, metrics, engine, tokenizer, scheduler, StopChecker(tokenizer, engine.eos_token_ids)).install()
