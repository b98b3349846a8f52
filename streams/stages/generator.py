"""The generator stage: assembled generate jobs in, tokens and one terminal event out.

Thin glue around a ``streams.cores.generation.GenerationCore`` (scheduler, engine, KV and
prefix bookkeeping; no Kafka). Intake turns a job into a prompt, refuses at once what cannot
run or would wait past the TTFT bound (``streams.policies.gen_admission``: ``overloaded``
with ``retry_after_ms``), and submits the rest to the core without acknowledging the job.
The step loop runs ``core.step()`` in the engine thread, streams new text as ``token``
events in order, and on a sequence's end sends its ``result`` (or ``error``) event and only
then acknowledges the job, so a crash repeats a generation (the SDK shows each (kind, seq)
once) but never loses one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
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
from streams.cores.generation import GenerationCore, GenerationRequest, GenerationUpdate, calibrate
from streams.observe.metrics import Metrics
from streams.policies.calibration import PredictionCalibration
from streams.policies.gen_admission import retry_after_ms, ttft_bound_ms
from streams.policies.gen_price import GenCost
from streams.policies.scheduler import ContinuousBatchScheduler, SchedulerLimits, StaticBatchScheduler
from streams.runtime.priority import Lowered
from streams.runtime.produce import Out, out_map
from streams.runtime.recovery import AnswerLedger, recover, stage_timings
from streams.runtime.stage import RecordStage
from streams.stores import load_reports
from workers import modalities
from workers import prompt as P
from workers.calibration import CalibrationCache
from workers.engines import EngineOptions, load_engine
from workers.engines.lm import GENERATION_FILE, StopChecker
from workers.engines.lm_types import LMError, SamplingParams
from workers.prefix_cache import PrefixCache
from workers.redisconn import connect_async
from workers.repository import ModelRepository

log = logging.getLogger(__name__)
STAGE = "generate"
WARM_STEPS = 20  # engine steps a generator runs before its TTFT predictions may refuse work
COST_REPORT_S = 2.0  # how often a replica publishes its step cost for the router's price


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
    started_ms: float
    sent_text: str = ""
    next_seq: int = 1  # 0 was the router's `accepted`
    first_token_ms: float | None = None
    token_times: list[float] = field(default_factory=list)
    predicted_ttft_ms: float = 0.0  # what admission predicted from intake (unscaled), 0 = not predicted


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

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, core: GenerationCore,
                 tokenizer: Any) -> None:
        names = topic_names(settings)
        super().__init__(app, settings, [names.generate("rt")], [names.generate("bulk")])
        self.metrics = metrics
        self.core, self.tokenizer = core, tokenizer
        self.active: dict[str, Active] = {}
        self.answers = AnswerLedger(names.generator_done, float(settings.generator.done_retention_ms))
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-lm")
        self.every = max(1, settings.generator.stream_every_tokens)
        self.cross_tenant = settings.cache.cross_tenant
        self.max_active = settings.generator.max_queued
        self.ttft_bound_ms = float(settings.generator.ttft_bound_ms)
        self.calibration = PredictionCalibration()
        self.replayed: set[str] = set()
        """Jobs a previous owner of their partition took on: admitted once, never refused again."""
        # A prompt longer than the context times the vocabulary's longest token (in bytes, which
        # are at least its characters) cannot fit, so it is refused before it is tokenized.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = core.engine.max_context * longest
        self.replica = f"{STAGE}/{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.credits: dict[tuple[str | None, str], int] = {}
        """(router replica that charged them, tenant) -> output tokens the tenant was charged for
        and did not get, not yet given to Redis."""
        base = settings.local.nice_of(STAGE)
        self.lowered = Lowered(base, settings.quota.debt_nice,
                               on_move=lambda nice: metrics.set_cpu_nice(STAGE, nice, lowered=nice > base))
        """Runs the process lower while it holds a generation admitted in debt (``GenerateJob.background``)."""
        self.redis = connect_async(settings.redis.url, settings.redis.tls_ca, socket_timeout=0.2,
                                   socket_connect_timeout=0.2)

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
        if key in self.active or self.answers.answered(key):  # a repeat of a job running or answered
            if self.answers.answered(key):
                self.answers.sent.pop(key, None)
            self.io.finish([r])
            return
        now = now_ms()
        if job.deadline_at_ms <= now:
            self._fail(job, r, WireError(ErrorCode.DEADLINE_EXCEEDED, "the request reached the generator after its deadline"))
            return
        params = job.params or {}
        try:
            passages = tuple(str(p.get("text", "")) for p in job.passages or ())
            text = P.render_chatml(P.build_messages(prompt_parts(job.parts), P.PromptSettings(passages=passages)))
            if len(text) > self.max_prompt_chars:  # bounded before the tokenizer spends anything on it
                raise LMError(f"the prompt has {len(text)} characters; at most {self.max_prompt_chars} can fit "
                              f"the context of {self.core.engine.max_context} tokens")
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            sampling = SamplingParams(max_tokens=int(params.get("max_tokens", 64)),
                                      temperature=float(params.get("temperature", 0.0)),
                                      stop=tuple(params.get("stop") or ()))
            self.core.check(len(ids), sampling)
        except (LMError, ValueError, TypeError) as exc:
            self._fail(job, r, WireError(ErrorCode.INVALID_REQUEST, str(exc)))
            return
        refusal, predicted = self._admission(key, job.lane, len(ids), sampling.max_tokens)
        if refusal is not None:
            self._fail(job, r, refusal)
            return
        deadline = time.monotonic() + (job.deadline_at_ms - now) / 1000.0
        self.core.submit(GenerationRequest(key, tuple(ids), sampling, job.lane, arrived_at=time.monotonic(),
                                           deadline=deadline, cache_scope=self.cache_scope(job)))
        self.active[key] = Active(job, r, now, predicted_ttft_ms=predicted)
        self.io.hold([r])  # finished with its terminal event: never handled twice

    def _admission(self, key: str, lane: str, prompt_tokens: int, max_tokens: int) -> tuple[WireError | None, float]:
        """(``overloaded`` when the job's predicted TTFT is past its lane's bound, else None;
        the unscaled prediction, which calibrates later ones). Refused only on a measured
        prediction: by a core that has run steps of its own (its start-up calibration ran
        beside every other worker starting), with work ahead (an idle one must see steps to
        learn), and never a job a previous owner of its partition took on."""
        bound = ttft_bound_ms(self.ttft_bound_ms, lane)
        if not bound:
            return None, 0.0
        raw = self.core.predict_ttft_ms(prompt_tokens, lane, max_tokens)
        replayed = key in self.replayed
        self.replayed.discard(key)
        if not self.core.num_live or self.core.steps < WARM_STEPS or replayed:
            return None, raw
        predicted = self.calibration.scale(raw)
        if predicted <= bound:
            return None, raw
        return WireError(ErrorCode.OVERLOADED, f"the generator is busy: the first token would come in about "
                         f"{predicted:.0f} ms, past the {bound:.0f} ms bound",
                         retry_after_ms=retry_after_ms(predicted, bound)), raw

    def cache_scope(self, job: GenerateJob) -> str:
        """Whose prompt prefixes ``job`` may reuse: its tenant's only (a hit shows in the
        result's cached tokens), unless the deployment shares caches across tenants."""
        return "" if self.cross_tenant else job.tenant

    def _note_state(self) -> None:
        self.lowered.hold(sum(1 for a in self.active.values() if a.job.background))
        self.metrics.set_state(STAGE, active=len(self.active), done=len(self.answers.done))

    def poll_budget(self) -> int:
        """Bounded intake: at ``max_queued`` jobs held the runtime pauses the stage's topics."""
        return max(0, self.max_active - len(self.active))

    # -- the step loop -------------------------------------------------------------------

    async def on_started(self) -> None:
        await super().on_started()
        self.supervise("steps", self._steps_forever)
        self.supervise("cost", self._publish_cost_forever)

    def step_cost(self) -> GenCost:
        """What a step costs here, as the core's cost model has learned it, for the router's
        price of generate requests (``streams.policies.gen_price``)."""
        fixed, per_decode, per_prompt = (float(x) for x in self.core.cost.coef)
        return GenCost(fixed, per_decode, per_prompt, engine_threads(self.core.engine))

    async def _publish_cost_forever(self) -> None:
        prefix = self.settings.kafka.topic_prefix
        while not self.should_stop:  # best effort: the router keeps the last cost it read
            await load_reports.publish_gen_cost(self.redis, prefix, self.replica, self.step_cost().to_map(now_ms()))
            await self._give_back(prefix)
            await asyncio.sleep(COST_REPORT_S)

    def _credit(self, router: str | None, tenant: str, unused: int, delivered: asyncio.Task) -> None:
        """Owe ``tenant`` (at the ``router`` replica that charged it) the ``unused`` output tokens
        it was charged for and did not get, once
        ``delivered`` (the job's terminal event and done marker) is with the broker. Not before:
        a generator that dies before that has the job replayed, and the replay owes it again;
        one that dies after it and before the next hand-over to Redis owes nothing (the replay
        finds the done marker), so a tenant is given back at most once."""
        def owe(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is None and task.result() is True:
                self.credits[router, tenant] = self.credits.get((router, tenant), 0) + unused

        delivered.add_done_callback(owe)

    async def _give_back(self, prefix: str) -> None:
        """Hand what is owed to the routers (through Redis); kept for the next try if it fails."""
        owed, self.credits = self.credits, {}
        by_router: dict[str | None, dict[str, int]] = {}
        for (router, tenant), n in owed.items():
            by_router.setdefault(router, {})[tenant] = n
        if owed and not await load_reports.add_gen_credits(self.redis, prefix, by_router):
            for who, n in owed.items():
                self.credits[who] = self.credits.get(who, 0) + n

    async def _steps_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.should_stop:
            if not self.core.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            updates = await loop.run_in_executor(self.executor, self.core.step)
            self._stream(updates)
            for u in updates:
                if u.finish_reason is not None:
                    self._finish(u)
            self._note_state()

    def _stream(self, updates: list[GenerationUpdate]) -> None:
        outs: list[Out] = []
        now = now_ms()
        for u in updates:
            a = self.active.get(u.key)
            if a is None or (u.new_tokens == 0 and u.finish_reason is None):
                continue
            if u.new_tokens:
                a.token_times.append(now)
            if u.finish_reason not in (None, "eos", "stop", "max_tokens"):
                continue
            delta = u.text[len(a.sent_text):] if u.text.startswith(a.sent_text) else u.text
            due = len(a.token_times) % self.every == 0 or u.finish_reason is not None
            if delta and due:
                ev = Event(a.job.id, EventKind.TOKEN, a.next_seq, now,
                           payload={"text": delta, "tokens": u.completion_tokens})
                if not self.answers.already_sent(u.key, "token", a.next_seq):  # not sent before a takeover
                    outs.append(out_map(a.job.reply_to, a.job.id, ev.to_wire()))
                a.next_seq += 1
                a.sent_text = u.text
                if a.first_token_ms is None:
                    a.first_token_ms = now
                    self.calibration.observe(a.predicted_ttft_ms, now - a.started_ms)
        if outs:
            self.io.deliver(outs)

    def _finish(self, u: GenerationUpdate) -> None:
        a = self.active.pop(u.key, None)
        if a is None:
            return
        job, now = a.job, now_ms()
        if u.finish_reason == "deadline_exceeded":
            self._fail(job, a.record, WireError(ErrorCode.DEADLINE_EXCEEDED, "generation ended: deadline_exceeded"), a,
                       made=u.completion_tokens)
            return
        if u.finish_reason in ("error", "aborted"):
            code = ErrorCode.INVALID_REQUEST if u.code == "invalid_request" else ErrorCode.INTERNAL
            self._fail(job, a.record, WireError(code, u.error or "generation failed"), a, made=u.completion_tokens)
            return
        n = len(a.token_times)
        ttft = (a.first_token_ms or now) - job.accepted_at_ms
        tpot = (a.token_times[-1] - a.token_times[0]) / (n - 1) if n > 1 else None
        timings = stage_timings(job, STAGE, a.started_ms, now)
        timings.update(ttft_ms=round(ttft, 3), tpot_ms=round(tpot, 3) if tpot is not None else None)
        ev = Event(job.id, EventKind.RESULT, a.next_seq, now, timings=timings, payload={
            "task": "generate", "text": u.text, "finish_reason": u.finish_reason,
            "tokens": {"prompt": u.prompt_tokens, "completion": u.completion_tokens, "cached": u.cached_tokens},
            "parts": job.parts, **_used(job)})
        self._terminal(job, a.record, ev, made=u.completion_tokens)
        self.metrics.request_done(STAGE, "ok")
        self.metrics.observe_e2e("generate", job.lane, timings["e2e_ms"])
        self.metrics.observe_ttft(job.lane, ttft)
        if tpot is not None:
            self.metrics.observe_tpot(job.lane, tpot)

    def _fail(self, job: GenerateJob, record: ConsumerRecord, err: WireError, a: Active | None = None,
              made: int = 0) -> None:
        """``made``: the output tokens it made before it failed (none where it never started)."""
        seq = a.next_seq if a else 1
        now = now_ms()
        ev = Event(job.id, EventKind.ERROR, seq, now, error=err.to_wire(),
                   timings=stage_timings(job, STAGE, a.started_ms if a else now, now))
        self._terminal(job, record, ev, made)
        self.metrics.request_done(STAGE, "error", str(err.code))

    def _terminal(self, job: GenerateJob, record: ConsumerRecord, ev: Event, made: int) -> None:
        """The job's last event and its done marker; the job record is finished with them, and
        its tenant is owed the output tokens it was charged for beyond the ``made`` ones."""
        key = request_key(job.tenant, job.id)
        outs = self.answers.finish(key, job.reply_to, [out_map(job.reply_to, job.id, ev.to_wire())], ev.seq, now_ms())
        delivered = self.io.deliver(outs, [record])
        unused = max(0, (job.charged_tokens or 0) - max(0, made))
        if unused:
            self._credit(job.charged_by, job.tenant, unused, delivered)

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
                                  self.names.generator_done, tps, _opens, now_ms(), self.answers.retention_ms)
        except Exception:
            log.exception("generate: recovery of %s failed; replayed generations may repeat events", tps)
            return
        self.answers.take_over(found)
        if len(self.replayed) > 100_000:  # keys of jobs that never came back (answered elsewhere)
            self.replayed.clear()
        self.replayed.update(found.replayed)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        """Generations of revoked partitions stop here, unanswered; the next owner runs them
        again. The core frees their KV at its next step (the engine thread's to touch)."""
        gone = {(tp.topic, tp.partition) for tp in tps}
        for key, a in list(self.active.items()):
            if (a.record.topic, a.record.partition) in gone:
                self.core.cancel(key)
                self.active.pop(key)
        self.wake.set()

    async def idle(self) -> None:
        self.answers.prune(now_ms())
        self.metrics.set_state(STAGE, active=len(self.active), done=len(self.answers.done))


def _used(job: GenerateJob) -> dict[str, Any]:
    """For a retrieval-augmented answer: the passages its prompt held, as [n] numbers them."""
    if job.passages is None:
        return {}
    return {"collection": (job.params or {}).get("collection"),
            "passages": [{"n": i, "id": p.get("id"), "score": p.get("score")} for i, p in enumerate(job.passages, 1)]}


def _opens(rec: ConsumerRecord) -> tuple[str, str, str] | None:
    job = GenerateJob.from_wire(unpack(rec.value))
    return request_key(job.tenant, job.id), job.reply_to, job.id


def build_core(settings: Settings, observer: Any = None) -> tuple[GenerationCore, Any]:
    """The generation core the settings describe, its engine loaded (through the fidelity
    gate and its fallback), warmed up and its step cost calibrated; and the tokenizer."""
    import tokenizers

    g = settings.generator
    config = ModelRepository(settings.models.repository).resolve(settings.models.lm_model)
    generation = json.loads((config.directory / GENERATION_FILE).read_text(encoding="utf-8"))
    kv_bytes_per_token = int(generation["layers"]) * 2 * int(generation["kv_heads"]) * int(generation["head_dim"]) * 2
    extra = dict(threads=g.threads, max_sequences=g.max_running, kv_tokens=g.kv_cache_tokens,
                 prefix_tokens=g.prefix_cache_mb * 1024 * 1024 // kv_bytes_per_token)
    engine = load_engine(config, g.precision, EngineOptions.from_settings(settings.encoder),
                         stage=STAGE, observer=observer, **extra)
    info = engine.info
    kv_budget = g.kv_cache_tokens if info.backend == "llama-cpp" else 0  # the ONNX engine's KV grows per sequence
    if info.backend == "lm-onnxruntime" and g.prefix_cache_mb > 0:  # keyed by the variant that actually serves
        engine.prefix_cache = PrefixCache(g.prefix_cache_mb * 1024 * 1024, 16,
                                          f"{info.model}/{info.version}/{info.precision}")
    tokenizer = tokenizers.Tokenizer.from_file(str(config.tokenizer_path))
    engine.warmup()
    limits = SchedulerLimits(g.max_tokens_per_step, g.max_running, g.max_prefill_chunk, kv_budget)
    cls = StaticBatchScheduler if g.scheduler == "static" else ContinuousBatchScheduler
    core = GenerationCore(engine, cls(limits, engine.eos_token_ids), StopChecker(tokenizer, engine.eos_token_ids))
    cache = CalibrationCache(settings.local.state_dir / "calibration")
    identity = "/".join((info.model, info.version, info.precision, info.backend, info.provider, f"running={g.max_running}"))
    timed = cache.load(identity, g.threads, settings.encoder.calibration_max_age_s)
    if timed is None:
        cache.store(identity, g.threads, calibrate(core))
    else:
        for ms, decode, prompt in timed:
            core.cost.observe(ms, int(decode), int(prompt))
    return core, tokenizer


def engine_threads(engine: Any) -> int:
    """The CPU threads one engine step runs on (llama.cpp's ``threads``, ONNX Runtime's
    intra-op threads; 0 there means one per core)."""
    return int(getattr(engine, "threads", 0) or getattr(engine, "intra_op_threads", 0) or os.cpu_count() or 1)


def install_generator(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    core, tokenizer = build_core(settings, metrics)
    info = core.engine.info
    metrics.set_engine(STAGE, dataclasses.asdict(info))
    c = core.cost.coef
    log.info("generate: %s/%s %s on %s (%s), %s batching, step cost %.1f ms + %.2f/decode + %.3f/prompt token",
             info.model, info.version, info.precision, info.provider, info.backend, settings.generator.scheduler,
             c[0], c[1], c[2])
    GeneratorStage(app, settings, metrics, core, tokenizer).install()
