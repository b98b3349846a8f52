"""The generation core: scheduler, engine and sequence bookkeeping behind submit / step / cancel.

It knows no Kafka (vLLM's ``EngineCore`` is the model). A stage feeds it requests with
``submit`` and ``cancel`` from any thread; one thread calls ``step`` in a loop, and every
engine call happens inside ``step``, so an engine that is not thread-safe (llama.cpp) is only
ever touched by that thread. One step is: take what was submitted or cancelled, let the
scheduler decide who runs (rt first, deadlines, token and KV budgets), execute it as one
engine ``forward`` over every running sequence's chunk, sample, detect stops, update the
scheduler, and return one ``GenerationUpdate`` per sequence that produced a token or ended.

Sequences get their engine state (a llama.cpp slot, the ONNX engine's KV) only when the
scheduler admits them, so waiting requests hold no KV, and a prompt admitted after another
with the same head finds that head in the prefix cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from streams.policies.gen_admission import QueueState, StepCostModel, predict_ttft_ms
from streams.policies.scheduler import SequenceRequest
from workers.engines.lm_types import LMError, LMSequence, SamplingParams, StepOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as the core runs it."""

    key: str  # unique among live requests (the stage's ``tenant/id``)
    prompt: tuple[int, ...]  # prompt token ids
    sampling: SamplingParams
    lane: str  # "rt" or "bulk"
    arrived_at: float  # monotonic seconds
    deadline: float | None = None  # monotonic seconds
    cache_scope: str = ""  # whose cached prefixes it may reuse


@dataclass(frozen=True, slots=True)
class GenerationUpdate:
    """What one step did to one sequence: a new token, its end, or both.

    ``finish_reason`` is None while it runs; else ``eos``, ``stop``, ``max_tokens``,
    ``deadline_exceeded`` or ``error`` (then ``error`` says why and ``code`` is a stable
    error code: ``internal`` for a failed step, ``invalid_request`` for a request the engine
    refused)."""

    key: str
    text: str  # the whole generated text so far (stop strings cut off)
    completion_tokens: int
    new_tokens: int  # tokens this step added (0 or 1)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens that came from the prefix cache
    finish_reason: str | None = None
    error: str = ""
    code: str = ""
    token_ids: tuple[int, ...] = ()  # the generated ids, on the update that ends it


class GenerationCore:
    """``engine``: an LM engine (``workers.engines.lm.LMEngine`` or
    ``workers.engines.llama.LlamaEngine``); ``scheduler``: a ``ContinuousBatchScheduler``
    (or the static baseline) whose ``max_running`` the engine can hold; ``stops``: a
    ``StopChecker`` (detokenizes and finds stop strings), or None for token ids only."""

    def __init__(self, engine: Any, scheduler: Any, stops: Any = None,
                 clock: Callable[[], float] = time.monotonic, cost: StepCostModel | None = None) -> None:
        self.engine, self.scheduler, self.stops, self.clock = engine, scheduler, stops, clock
        self.cost = cost or StepCostModel()
        self.last_step: tuple[float, int, int] = (0.0, 0, 0)  # (ms, decodes, prefill tokens) of the last step
        self.steps = 0  # engine steps run (calibration not counted)
        self._state = self._queue_state()
        self._lock = threading.Lock()
        # Submits and cancels in the order they came: a cancel then a new submit of the same
        # key (a partition lost and taken back) must not cancel the new one.
        self._inbox: deque[GenerationRequest | str] = deque()
        self._requests: dict[str, GenerationRequest] = {}  # submitted, not ended (engine thread)
        self._seqs: dict[str, LMSequence] = {}  # admitted: hold engine state
        self._cached: dict[str, int] = {}  # admitted: prompt tokens the prefix cache gave
        self._refused: list[GenerationUpdate] = []
        self._live = 0  # submitted, not yet ended or cancelled (read by the intake thread)

    # -- any thread -----------------------------------------------------------------------

    def check(self, prompt_len: int, sampling: SamplingParams) -> None:
        """Raise ``LMError`` now for a request the engine could never run (empty prompt,
        prompt + ``max_tokens`` past the context), so a stage can answer it at intake."""
        if prompt_len < 1:
            raise LMError("empty prompt")
        if prompt_len + sampling.max_tokens > self.engine.max_context:
            raise LMError(f"prompt of {prompt_len} tokens + max_tokens {sampling.max_tokens} exceeds "
                          f"the context of {self.engine.max_context}")

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request`` for the next step. Raises ``LMError`` as ``check`` does."""
        self.check(len(request.prompt), request.sampling)
        with self._lock:
            self._inbox.append(request)
            self._live += 1

    def cancel(self, key: str) -> None:
        """End ``key`` at the next step without an update (its caller has let it go); a
        later ``submit`` of the same key is a new request."""
        with self._lock:
            self._inbox.append(key)

    def predict_ttft_ms(self, prompt_tokens: int, lane: str, max_tokens: int = 0) -> float:
        """Predicted ms to the first token of a request submitted now (``streams.policies.
        gen_admission``): what the last step left queued and running, plus what was
        submitted since."""
        with self._lock:
            state = self._state
            extra = [r for r in self._inbox if not isinstance(r, str)]
        waiting = dict(state.waiting)
        tokens = dict(state.waiting_tokens)
        for r in extra:
            waiting[r.lane] = waiting.get(r.lane, 0) + 1
            tokens[r.lane] = tokens.get(r.lane, 0) + len(r.prompt)
        cells = dict(state.waiting_cells or {})
        for r in extra:
            cells[r.lane] = cells.get(r.lane, 0) + len(r.prompt) + r.sampling.max_tokens
        state = QueueState(state.running, state.max_running, state.max_tokens_per_step, state.remaining,
                           tokens, waiting, state.reservations, state.kv_budget, cells)
        return predict_ttft_ms(self.cost, state, prompt_tokens, lane, cells=prompt_tokens + max_tokens)

    @property
    def num_live(self) -> int:
        """Requests submitted and not ended or cancelled (waiting, running or not taken in)."""
        with self._lock:
            return self._live

    @property
    def has_work(self) -> bool:
        with self._lock:
            queued = bool(self._inbox)
        return queued or self.scheduler.has_work or bool(self._refused)

    # -- the step thread ------------------------------------------------------------------

    def step(self) -> list[GenerationUpdate]:
        """Run one step (see the module docstring); returns its updates, ends included."""
        try:
            return self._step()
        finally:
            state = self._queue_state()
            with self._lock:
                self._state = state

    def _queue_state(self) -> QueueState:
        limits = self.scheduler.limits
        by_lane = self.scheduler.waiting_by_lane()
        return QueueState(self.scheduler.num_running, limits.max_running, limits.max_tokens_per_step,
                          self.scheduler.remaining_tokens(), {l: t for l, (_, t) in by_lane.items()},
                          {l: n for l, (n, _) in by_lane.items()}, self.scheduler.reservations(),
                          limits.max_kv_tokens, self.scheduler.waiting_cells())

    def _step(self) -> list[GenerationUpdate]:
        self._take_inbox()
        updates, self._refused = self._refused, []
        if not self.scheduler.has_work:
            return updates
        now = self.clock()
        out = self.scheduler.schedule(now, on_admit=self._admit)
        for seq_id, reason in out.dropped:
            if seq_id in self._requests or seq_id in self._seqs:  # not one refused at admission
                updates.append(self._end(seq_id, reason))
        updates.extend(self._refused)
        self._refused = []
        chunks = [(c.seq_id, c.num_tokens, c.is_last) for c in out.prefill] + [(s, 1, True) for s in out.decode]
        chunks = [c for c in chunks if c[0] in self._seqs]
        if not chunks:
            self.scheduler.update(StepOutput(tokens={}))
            return updates
        try:
            step = self._execute(chunks)
        except Exception as exc:  # a failed step fails the sequences in it, not the core
            log.exception("generation step failed")
            return updates + self._fail_step(chunks, f"generation failed: {exc!r}")
        dropped = {seq_id for seq_id, _ in out.dropped}  # ended above; update() lists them again
        for fin in self.scheduler.update(step):
            if fin.seq_id not in dropped:
                updates.append(self._end(fin.seq_id, fin.reason, produced=fin.seq_id in step.tokens))
        for seq_id in step.tokens:
            seq = self._seqs.get(seq_id)
            if seq is not None:
                updates.append(self._update(seq_id, seq, new_tokens=1))
        return updates

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, deque()
        for item in inbox:
            if isinstance(item, str):
                self._cancel(item)
                continue
            r = item
            try:
                self.scheduler.add(SequenceRequest(r.key, len(r.prompt), r.sampling.max_tokens, r.lane,
                                                   arrived_at=r.arrived_at, deadline=r.deadline,
                                                   ignore_eos=r.sampling.ignore_eos))
            except Exception as exc:  # one bad request ends alone; the rest of the inbox goes on
                self._refused.append(GenerationUpdate(r.key, "", 0, 0, len(r.prompt), 0, "error", str(exc),
                                                      getattr(exc, "code", "internal")))
                self._ended()
                continue
            self._requests[r.key] = r
        state = self._queue_state()  # what was taken in is priced by admission from now on
        with self._lock:
            self._state = state

    def _cancel(self, key: str) -> None:
        if key in self._requests or key in self._seqs:
            self._ended()
        self.scheduler.abort(key, self.clock())
        self._requests.pop(key, None)
        self._release(key)

    def _ended(self) -> None:
        with self._lock:
            self._live -= 1

    def _admit(self, key: str) -> int | None:
        """The scheduler admits ``key``: give it engine state; returns its cached prompt
        tokens, or None when the engine refuses it (it ends with an ``error`` update)."""
        r = self._requests[key]
        try:
            seq = self.engine.new_sequence(key, list(r.prompt), r.sampling, cache_scope=r.cache_scope)
        except Exception as exc:  # refused by the engine: ended at this step, nothing runs
            self._refused.append(GenerationUpdate(key, "", 0, 0, len(r.prompt), 0, "error", str(exc),
                                                  getattr(exc, "code", "internal")))
            self._requests.pop(key, None)
            self._ended()
            return None
        self._seqs[key] = seq
        self._cached[key] = seq.num_cached
        return seq.num_cached

    def _execute(self, chunks: list[tuple[str, int, bool]]) -> StepOutput:
        seqs = [self._seqs[k] for k, _, _ in chunks]
        started = time.perf_counter()
        logits = self.engine.forward([(s, n) for s, (_, n, _) in zip(seqs, chunks)])
        ms = (time.perf_counter() - started) * 1000.0
        decodes = sum(1 for s, (_, n, _) in zip(seqs, chunks) if n == 1 and s.num_cached > s.prompt_len)
        prefill = sum(n for _, n, _ in chunks) - decodes
        self.cost.observe(ms, decodes, prefill)
        self.last_step = (ms, decodes, prefill)
        self.steps += 1
        tokens: dict[str, int] = {}
        stopped = set()
        for seq, (key, _, emits), row in zip(seqs, chunks, logits):
            if not emits:
                continue
            token = self.engine.sample(seq, row)
            tokens[key] = token
            self.engine.append(seq, token)
            if self.stops is not None and self.stops.check(seq):
                stopped.add(key)
        return StepOutput(tokens=tokens, stopped=frozenset(stopped))

    def _fail_step(self, chunks: list[tuple[str, int, bool]], message: str) -> list[GenerationUpdate]:
        now = self.clock()
        keys = [k for k, _, _ in chunks]
        for key in keys:
            self.scheduler.abort(key, now)
        # The step owed these tokens; their sequences are aborted, so none is used.
        self.scheduler.update(StepOutput(tokens={k: 0 for k, _, emits in chunks if emits}))
        return [self._end(key, "error", error=message, code="internal") for key in keys]

    def _end(self, key: str, reason: str, produced: bool = False, error: str = "", code: str = "") -> GenerationUpdate:
        self._ended()
        r = self._requests.pop(key, None)
        seq = self._seqs.get(key)
        update = (self._update(key, seq, 1 if produced else 0, reason, error, code) if seq is not None else
                  GenerationUpdate(key, "", 0, 0, len(r.prompt) if r else 0, 0, reason, error, code))
        self._release(key)
        return update

    def _update(self, key: str, seq: LMSequence, new_tokens: int, reason: str | None = None,
                error: str = "", code: str = "") -> GenerationUpdate:
        return GenerationUpdate(key, seq.text, len(seq.generated), new_tokens, seq.prompt_len,
                                self._cached.get(key, 0), reason, error, code,
                                tuple(seq.generated) if reason is not None else ())

    def _release(self, key: str) -> None:
        seq = self._seqs.pop(key, None)
        self._cached.pop(key, None)
        if seq is not None:
            self.engine.release(seq)


def calibrate(core: GenerationCore, prompt_tokens: int = 96, steps: int = 6) -> list[tuple[float, int, int]]:
    """Measure the engine's step cost before serving: a prompt alone, then decode steps of one
    and of ``max_running`` sequences, each observed by ``core.cost`` (so admission prices
    the first requests from this machine, not from the defaults); returns the observations
    (ms, decode rows, prompt tokens), which another replica may replay instead of timing
    them. Runs engine calls: call it from the engine thread, before the core serves."""
    engine = core.engine
    width = max(1, min(core.scheduler.limits.max_running, 4))
    # Tokens no earlier prompt used (the warm-up's are pad tokens), one prompt per sequence,
    # so each prefill is a whole one and none hits the prefix cache.
    base = min(engine.eos_token_ids) + 2
    seqs = [engine.new_sequence(f"calibrate-{i}", [base + i] * prompt_tokens, SamplingParams(max_tokens=steps + 1))
            for i in range(width)]
    try:
        prefills = []
        for seq in seqs:
            started = time.perf_counter()
            engine.forward([(seq, seq.prompt_len - seq.num_cached)])
            prefills.append(((time.perf_counter() - started) * 1000.0, seq.prompt_len))
            engine.append(seq, base)
        # The fastest prompt: a worker calibrates while its neighbours start on the same cores.
        ms, n = min(prefills)
        seen = [(ms, 0, n)]
        core.cost.observe(ms, 0, n)
        for group in (seqs[:1], seqs):
            for _ in range(steps // 2):
                started = time.perf_counter()
                engine.forward([(s, 1) for s in group])
                seen.append(((time.perf_counter() - started) * 1000.0, len(group), 0))
                core.cost.observe(*seen[-1])
                for s in group:
                    engine.append(s, base)
    finally:
        for seq in seqs:
            engine.release(seq)
    return seen
