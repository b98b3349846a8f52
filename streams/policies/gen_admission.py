"""Admission for generate requests: predict a request's time to first token from what is
queued and running, and refuse it at once when that is past the bound (what the router
charges the tenant's quota for one is ``streams.policies.gen_price``).

Pure policy over plain data (the generation core fills in ``QueueState``; the stage acts).

The price of a step is learned from measured steps: ``ms = fixed + per_decode * decodes +
per_prefill_token * prefill_tokens`` (``StepCostModel``, least squares over recent steps with
exponential forgetting, started from a calibration). The prediction (``predict_ttft_ms``) is
the time to prefill everything queued ahead of the request plus its own prompt, at the step
budget left after the running sequences' decodes, plus, when no slot will be free for it, the
time until enough running sequences end (each at its remaining ``max_tokens``, an upper
bound: eos ends many sooner). It is an estimate for shedding, not a promise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LANES = ("rt", "bulk")


@dataclass(frozen=True, slots=True)
class QueueState:
    """What waits and runs in one generation core, as ``predict_ttft_ms`` needs it."""

    running: int  # sequences holding a slot
    max_running: int
    max_tokens_per_step: int
    remaining: tuple[int, ...]  # tokens each running sequence may still generate
    waiting_tokens: dict[str, int]  # lane -> prompt tokens of sequences not admitted yet
    waiting: dict[str, int]  # lane -> sequences not admitted yet
    reservations: tuple[int, ...] = ()  # KV cells each running sequence holds, in ``remaining``'s order
    kv_budget: int = 0  # KV cells running sequences may reserve; 0 = no bound
    waiting_cells: dict[str, int] | None = None  # lane -> KV cells the waiting sequences will reserve


class StepCostModel:
    """Milliseconds of one engine step from its decodes and prefill tokens (see the module
    docstring). ``observe`` refits from the step just measured; ``forget`` is the weight kept
    by older steps at each observation."""

    def __init__(self, fixed_ms: float = 5.0, per_decode_ms: float = 1.0, per_prefill_token_ms: float = 0.5,
                 forget: float = 0.98, prior_weight: float = 5.0) -> None:
        self.forget = forget
        self._prior = np.array([fixed_ms, per_decode_ms, per_prefill_token_ms])
        self._xtx = np.eye(3) * prior_weight
        self._xty = self._xtx @ self._prior
        self.coef = self._prior.copy()
        self.observed = 0

    def observe(self, ms: float, decodes: int, prefill_tokens: int) -> None:
        x = np.array([1.0, float(decodes), float(prefill_tokens)])
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + x * float(ms)
        # Ridge toward the prior keeps a coefficient the recent steps do not show (no
        # prefill for a while) where it was, rather than letting it drift to anything.
        coef = np.linalg.solve(self._xtx + np.eye(3) * 1e-3, self._xty + 1e-3 * self._prior)
        self.coef = np.maximum(coef, 0.0)
        self.observed += 1

    def step_ms(self, decodes: int, prefill_tokens: int) -> float:
        return float(self.coef @ np.array([1.0, float(decodes), float(prefill_tokens)]))


def predict_ttft_ms(model: StepCostModel, state: QueueState, prompt_tokens: int, lane: str,
                    cells: int = 0) -> float:
    """Predicted milliseconds from now to the first token of a request of ``prompt_tokens``
    (reserving ``cells`` KV cells) on ``lane`` that joins the back of its lane's queue (rt
    waits only for rt; bulk for both)."""
    ahead = LANES[:LANES.index(lane) + 1]
    work = prompt_tokens + sum(state.waiting_tokens.get(l, 0) for l in ahead)
    queued = 1 + sum(state.waiting.get(l, 0) for l in ahead)
    free = state.max_running - state.running
    ends = sorted(zip(state.remaining, state.reservations or (0,) * len(state.remaining)))
    decode_step = model.step_ms(state.running, 0)
    wait_steps = 0
    if queued > free and ends:
        # The (queued - free)-th sequence to end frees the slot this request needs; past the
        # running ones, each wave of ``max_running`` waits about as long again.
        need = queued - free
        waves, index = divmod(need - 1, len(ends))
        wait_steps = ends[index][0] + waves * ends[-1][0]
    if state.kv_budget:
        # Cells: those reserved now and by the ones ahead, less what ends free, in order of ending.
        ahead_cells = sum((state.waiting_cells or {}).get(l, 0) for l in ahead)
        short = sum(r for _, r in ends) + ahead_cells + cells - state.kv_budget
        for remaining, reserved in ends:
            if short <= 0:
                break
            short -= reserved
            wait_steps = max(wait_steps, remaining)
    decodes = min(state.running, state.max_running)
    per_step = max(1, state.max_tokens_per_step - decodes)
    steps = math.ceil(work / per_step)
    return wait_steps * decode_step + steps * model.step_ms(decodes, min(work, per_step))


MAX_RETRY_AFTER_MS = 30_000


def retry_after_ms(predicted_ms: float, bound_ms: float) -> int:
    """When a refused request may come back: when the work ahead of it should have drained
    to its bound, at least 100 ms and at most ``MAX_RETRY_AFTER_MS`` (the prediction counts
    every running sequence to its ``max_tokens``, so it is an upper bound)."""
    return int(min(MAX_RETRY_AFTER_MS, max(100.0, predicted_ms - bound_ms)))


def ttft_bound_ms(bound_ms: float, lane: str) -> float:
    """The TTFT a lane is held to: the setting for rt, ten times it for bulk; 0 = none."""
    return bound_ms if lane == "rt" else bound_ms * 10
