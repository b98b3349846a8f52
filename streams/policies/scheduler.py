"""Step-level scheduling of text generation: which sequences run in the next model step.

One step is schedule -> execute -> update (as in vLLM v1). The scheduler is pure policy over
plain data: it does no I/O, knows nothing of the model, and takes ``now`` (monotonic
seconds) as an argument. It fills in the engines' plan type (``workers.engines.lm_types.StepPlan``);
the caller executes it (``streams.cores.generation.GenerationCore``) and hands back a ``StepOutput``;
call ``update`` once per ``schedule``.

Per step, in this order, until ``max_tokens_per_step`` tokens are spent:

1. sequences past their deadline (waiting or running) are dropped: ``deadline_exceeded``;
2. rt lane: every decoding sequence gets 1 token, then prefilling sequences get their next
   chunk, then waiting sequences are admitted (while fewer than ``max_running`` run and
   their KV reservation, prompt + ``max_tokens``, fits ``max_kv_tokens``);
3. bulk lane: the same, except that no bulk sequence is admitted while an rt one waits for
   a slot or cells (a smaller bulk one would take what the rt one waits for).

rt goes before bulk at every decision, so bulk work only gets what rt left of the budget
(a running sequence is never preempted, so a running bulk sequence keeps its slot). A
prompt longer than the budget left is prefilled in chunks over several steps (chunked
prefill), at most ``max_prefill_chunk`` tokens each; decodes go first so that a long prompt
never stalls the sequences already streaming.

``ContinuousBatchScheduler`` admits whenever a slot is free. ``StaticBatchScheduler`` admits
only when nothing runs: it collects a batch, runs it to completion, then the next (the
baseline the benchmark compares against).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from workers.engines.lm_types import PrefillChunk, StepOutput, StepPlan

LANES = ("rt", "bulk")


class SchedulerError(ValueError):
    """The scheduler was called with data that breaks its contract."""

    code = "internal"
    retriable = False


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, nothing computed
    PREFILLING = "prefilling"  # admitted; prompt partly computed
    DECODING = "decoding"  # prompt done; one token per step
    FINISHED_EOS = "finished_eos"
    FINISHED_STOP = "finished_stop"
    FINISHED_LENGTH = "finished_length"
    DROPPED_DEADLINE = "dropped_deadline"
    ABORTED = "aborted"


TERMINAL = frozenset({
    SequenceStatus.FINISHED_EOS,
    SequenceStatus.FINISHED_STOP,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.DROPPED_DEADLINE,
    SequenceStatus.ABORTED,
})

# What the client sees for each terminal status.
FINISH_REASON: Mapping[SequenceStatus, str] = {
    SequenceStatus.FINISHED_EOS: "eos",
    SequenceStatus.FINISHED_STOP: "stop",
    SequenceStatus.FINISHED_LENGTH: "max_tokens",
    SequenceStatus.DROPPED_DEADLINE: "deadline_exceeded",
    SequenceStatus.ABORTED: "aborted",
}

_ENDINGS = {SequenceStatus.DROPPED_DEADLINE, SequenceStatus.ABORTED}
TRANSITIONS: Mapping[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.PREFILLING, *_ENDINGS}),
    SequenceStatus.PREFILLING: frozenset({SequenceStatus.PREFILLING, SequenceStatus.DECODING, *TERMINAL}),
    SequenceStatus.DECODING: frozenset(TERMINAL),
    **{s: frozenset() for s in TERMINAL},
}


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_tokens_per_step: int = 256  # prefill + decode tokens in one model step
    max_running: int = 8  # sequences holding KV state (prefilling or decoding)
    max_prefill_chunk: int = 256  # most prompt tokens of one sequence in one step
    max_kv_tokens: int = 0  # KV cells running sequences may reserve (prompt + max_tokens each); 0 = no bound

    def __post_init__(self) -> None:
        if min(self.max_tokens_per_step, self.max_running, self.max_prefill_chunk) < 1 or self.max_kv_tokens < 0:
            raise SchedulerError(f"invalid scheduler limits {self}")


@dataclass(frozen=True, slots=True)
class SequenceRequest:
    """What the scheduler needs to know about one generation request."""

    seq_id: str
    prompt_len: int  # prompt tokens
    max_tokens: int  # most tokens to generate
    lane: str  # "rt" or "bulk"
    arrived_at: float  # monotonic seconds
    deadline: float | None = None  # monotonic seconds; None = none
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    ignore_eos: bool = False  # end only at max_tokens or a stop string (benchmarks)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's work. Every field is a decision the executor carries out."""

    plan: StepPlan  # what the engine computes this step (the engine's own type), rt first
    dropped: tuple[tuple[str, str], ...]  # (seq_id, reason) ended before this step; free their state
    num_tokens: int  # tokens this step computes: len(decode) + sum of chunk sizes

    @property
    def decode(self) -> tuple[str, ...]:
        return self.plan.decode

    @property
    def prefill(self) -> tuple[PrefillChunk, ...]:
        return self.plan.prefill

    @property
    def is_empty(self) -> bool:
        return not self.plan.decode and not self.plan.prefill


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence that reached a terminal status, with its output."""

    seq_id: str
    status: SequenceStatus
    reason: str  # FINISH_REASON[status]
    tokens: tuple[int, ...]
    lane: str
    history: tuple[tuple[SequenceStatus, float], ...] = ()  # (status, monotonic s) per transition, arrival first


@dataclass(slots=True)
class _Sequence:
    request: SequenceRequest
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # prompt tokens with KV
    output: list[int] = field(default_factory=list)
    history: list[tuple[SequenceStatus, float]] = field(default_factory=list)

    def move(self, status: SequenceStatus, now: float) -> None:
        if status not in TRANSITIONS[self.status]:
            raise SchedulerError(f"{self.request.seq_id}: {self.status.value} -> {status.value} is not allowed")
        self.status = status
        self.history.append((status, now))


class ContinuousBatchScheduler:
    """Continuous batching: a free slot is filled at the next step.

    ``eos_token_ids`` end a sequence (status ``FINISHED_EOS``; the token is kept in its
    output, the caller decides whether to show it).
    """

    def __init__(self, limits: SchedulerLimits, eos_token_ids: Iterable[int] = ()) -> None:
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self._waiting: dict[str, deque[_Sequence]] = {lane: deque() for lane in LANES}
        self._running: dict[str, _Sequence] = {}  # admission order
        self._pending: SchedulerOutput | None = None
        self._pending_at = 0.0
        self._dropped_now: list[Finished] = []
        self._admitting = True  # StaticBatchScheduler closes admission while a batch runs

    # -- queue ----------------------------------------------------------------------------

    def add(self, request: SequenceRequest) -> None:
        """Queue a request. Raises ``SchedulerError`` for an unknown lane, an empty prompt,
        ``max_tokens`` < 1, a cached count not below the prompt length, or a duplicate id."""
        if request.lane not in LANES:
            raise SchedulerError(f"unknown lane {request.lane!r}; lanes: {LANES}")
        if request.prompt_len < 1 or request.max_tokens < 1:
            raise SchedulerError(f"{request.seq_id}: empty prompt or max_tokens < 1")
        if not 0 <= request.num_cached_tokens < request.prompt_len:
            raise SchedulerError(f"{request.seq_id}: num_cached_tokens must be in [0, prompt_len)")
        if request.seq_id in self._running or any(s.request.seq_id == request.seq_id for q in self._waiting.values() for s in q):
            raise SchedulerError(f"duplicate sequence id {request.seq_id!r}")
        seq = _Sequence(request, num_computed=request.num_cached_tokens)
        seq.history.append((SequenceStatus.WAITING, request.arrived_at))
        self._waiting[request.lane].append(seq)

    def abort(self, seq_id: str, now: float) -> Finished | None:
        """End a sequence now (client gone); None when it is unknown or already ended."""
        for queue in self._waiting.values():
            for seq in queue:
                if seq.request.seq_id == seq_id:
                    queue.remove(seq)
                    return self._finish(seq, SequenceStatus.ABORTED, now)
        seq = self._running.pop(seq_id, None)
        return None if seq is None else self._finish(seq, SequenceStatus.ABORTED, now)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._running) or self.num_waiting > 0

    def waiting_by_lane(self) -> dict[str, tuple[int, int]]:
        """lane -> (sequences waiting, their prompt tokens not computed yet)."""
        return {lane: (len(q), sum(s.request.prompt_len - s.num_computed for s in q))
                for lane, q in self._waiting.items()}

    def remaining_tokens(self) -> tuple[int, ...]:
        """Tokens each running sequence may still generate (its max_tokens less its output)."""
        return tuple(s.request.max_tokens - len(s.output) for s in self._running.values())

    def reservations(self) -> tuple[int, ...]:
        """KV cells each running sequence reserves, in ``remaining_tokens``' order."""
        return tuple(_reservation(s) for s in self._running.values())

    def waiting_cells(self) -> dict[str, int]:
        """lane -> KV cells the waiting sequences will reserve when admitted."""
        return {lane: sum(_reservation(s) for s in q) for lane, q in self._waiting.items()}

    def status(self, seq_id: str) -> SequenceStatus | None:
        """Status of a live sequence; None once it has ended (``Finished`` said how)."""
        if seq_id in self._running:
            return self._running[seq_id].status
        for queue in self._waiting.values():
            for seq in queue:
                if seq.request.seq_id == seq_id:
                    return seq.status
        return None

    # -- one step -------------------------------------------------------------------------

    def schedule(self, now: float, on_admit: Callable[[str], int | None] | None = None) -> SchedulerOutput:
        """Decide the next step (see the module docstring). ``on_admit(seq_id)``, when
        given, is told of each sequence admitted now and returns how many of its prompt
        tokens already have KV (a prefix cache hit found at admission; below the prompt
        length) or None when it cannot start (it is then ended as ``ABORTED`` and listed in
        ``dropped``). Raises ``SchedulerError`` when the previous step's ``update`` is
        missing."""
        if self._pending is not None:
            raise SchedulerError("schedule() called twice without update()")
        dropped = self._drop_expired(now)
        budget = self.limits.max_tokens_per_step
        decode: list[str] = []
        prefill: list[PrefillChunk] = []
        blocked = False
        for lane in LANES:
            lane_running = [s for s in self._running.values() if s.request.lane == lane]
            for seq in lane_running:
                if seq.status is SequenceStatus.DECODING and budget > 0:
                    decode.append(seq.request.seq_id)
                    budget -= 1
            for seq in lane_running:
                if seq.status is SequenceStatus.PREFILLING and budget > 0:
                    chunk = self._chunk(seq, budget)
                    prefill.append(chunk)
                    budget -= chunk.num_tokens
            queue = self._waiting[lane]
            if blocked:  # a higher lane's head waits for a slot or KV cells: nothing jumps it
                continue
            while queue and budget > 0 and self._may_admit(queue[0]):
                seq = queue.popleft()
                if on_admit is not None:
                    cached = on_admit(seq.request.seq_id)
                    if cached is None:
                        dropped.append(self._finish(seq, SequenceStatus.ABORTED, now))
                        continue
                    seq.num_computed = max(seq.num_computed, min(int(cached), seq.request.prompt_len - 1))
                seq.move(SequenceStatus.PREFILLING, now)
                self._running[seq.request.seq_id] = seq
                chunk = self._chunk(seq, budget)
                prefill.append(chunk)
                budget -= chunk.num_tokens
            blocked = bool(queue) and budget > 0
        out = SchedulerOutput(
            plan=StepPlan(decode=tuple(decode), prefill=tuple(prefill)),
            dropped=tuple((f.seq_id, f.reason) for f in dropped),
            num_tokens=self.limits.max_tokens_per_step - budget,
        )
        self._pending, self._pending_at = out, now
        self._dropped_now = dropped
        return out

    def update(self, step: StepOutput) -> list[Finished]:
        """Apply the executed step: advance prompts, append tokens, end sequences (eos,
        stop string, max_tokens). Returns the sequences that ended in this step, the ones
        ``schedule`` dropped included. Raises ``SchedulerError`` when a token the step owed
        is missing or one was given for a sequence that did not run."""
        out, now = self._pending, self._pending_at
        if out is None:
            raise SchedulerError("update() without a scheduled step")
        owed = set(out.decode) | {c.seq_id for c in out.prefill if c.is_last}
        if set(step.tokens) != owed:
            raise SchedulerError(f"step tokens for {sorted(step.tokens)}, expected {sorted(owed)}")
        self._pending = None
        finished = list(self._dropped_now)
        for chunk in out.prefill:
            seq = self._running.get(chunk.seq_id)
            if seq is None:  # aborted between schedule and update
                continue
            seq.num_computed += chunk.num_tokens
            seq.move(SequenceStatus.DECODING if chunk.is_last else SequenceStatus.PREFILLING, now)
        for seq_id, token in step.tokens.items():
            seq = self._running.get(seq_id)
            if seq is None:
                continue
            seq.output.append(int(token))
            if token in self.eos_token_ids and not seq.request.ignore_eos:
                ending = SequenceStatus.FINISHED_EOS
            elif seq_id in step.stopped:
                ending = SequenceStatus.FINISHED_STOP
            elif len(seq.output) >= seq.request.max_tokens:
                ending = SequenceStatus.FINISHED_LENGTH
            else:
                continue
            del self._running[seq_id]
            finished.append(self._finish(seq, ending, now))
        return finished

    def history(self, seq_id: str) -> list[tuple[SequenceStatus, float]]:
        """Timestamped transitions of a running sequence (``Finished`` carries the whole
        record of an ended one)."""
        seq = self._running.get(seq_id)
        return list(seq.history) if seq is not None else []

    # -- policy pieces --------------------------------------------------------------------

    def _may_admit(self, seq: _Sequence) -> bool:
        if len(self._running) >= self.limits.max_running:
            return False
        if not self.limits.max_kv_tokens:
            return True
        reserved = sum(_reservation(s) for s in self._running.values())
        # A sequence larger than the whole budget still runs alone rather than never.
        return reserved + _reservation(seq) <= self.limits.max_kv_tokens or not self._running

    def _chunk(self, seq: _Sequence, budget: int) -> PrefillChunk:
        remaining = seq.request.prompt_len - seq.num_computed
        n = min(remaining, budget, self.limits.max_prefill_chunk)
        return PrefillChunk(seq.request.seq_id, seq.num_computed, n, is_last=n == remaining)

    def _drop_expired(self, now: float) -> list[Finished]:
        dropped = []
        for queue in self._waiting.values():
            for seq in [s for s in queue if _expired(s, now)]:
                queue.remove(seq)
                dropped.append(self._finish(seq, SequenceStatus.DROPPED_DEADLINE, now))
        for seq in [s for s in self._running.values() if _expired(s, now)]:
            del self._running[seq.request.seq_id]
            dropped.append(self._finish(seq, SequenceStatus.DROPPED_DEADLINE, now))
        return dropped

    def _finish(self, seq: _Sequence, status: SequenceStatus, now: float) -> Finished:
        seq.move(status, now)
        r = seq.request
        return Finished(r.seq_id, status, FINISH_REASON[status], tuple(seq.output), r.lane, tuple(seq.history))


class StaticBatchScheduler(ContinuousBatchScheduler):
    """Static batching: admit up to ``max_running`` only when nothing runs, then run that
    batch to completion (its prompts still chunked under the token budget)."""

    def schedule(self, now: float, on_admit: Callable[[str], int | None] | None = None) -> SchedulerOutput:
        self._admitting = not self._running
        return super().schedule(now, on_admit)

    def _may_admit(self, seq: _Sequence) -> bool:
        return self._admitting and super()._may_admit(seq)


def _reservation(seq: _Sequence) -> int:
    return seq.request.prompt_len + seq.request.max_tokens


def _expired(seq: _Sequence, now: float) -> bool:
    return seq.request.deadline is not None and now > seq.request.deadline
