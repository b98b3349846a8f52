"""What a generate request costs before any of it runs: the router's price for the tenant's
compute quota (``quota.compute_ms_per_s``, in CPU milliseconds). Pure.

The price is the generator's own measured step cost, not a constant: each generator replica
publishes the step cost its ``StepCostModel`` learned on its machine, with the threads its
engine computes with (``GenCost``, through ``streams.stores.load_reports``), and the router
prices with the dearest fresh one (``costliest``). Before any replica has reported, it prices
with ``ROUTER_GEN_COST``.

A request is priced as if it ran alone: its prompt's prefill, then ``max_tokens`` steps
that each pay the step's whole fixed cost, all times the engine's threads (a step keeps
every one of them busy). The router cannot know which sequences will share its steps, and a
sequence that runs alone does cost that much; one that shares its steps with seven others
costs about half of it (with the costs below), so a tenant that keeps the generator's
batches full pays up to twice its share of the CPU (an operator who knows its traffic
keeps them full may say how full: ``quota.generation_shared_by``). A bound must not be below
what it bounds. ``max_tokens`` is paid whether or not eos comes first (as a KV reservation
is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class GenCost:
    """One generator's step cost: ``fixed_ms`` per step, ``per_decode_ms`` per sequence
    decoding in it, ``per_prompt_ms`` per prompt token prefilled (wall milliseconds of the
    engine, from ``StepCostModel.coef``), and the CPU ``threads`` a step runs on."""

    fixed_ms: float
    per_decode_ms: float
    per_prompt_ms: float
    threads: int

    def to_map(self, at_ms: float) -> dict[str, Any]:
        return {"at": round(at_ms), "fixed_ms": round(self.fixed_ms, 4), "per_decode_ms": round(self.per_decode_ms, 4),
                "per_prompt_ms": round(self.per_prompt_ms, 5), "threads": self.threads}

    @classmethod
    def from_map(cls, m: Mapping[str, Any]) -> "GenCost":
        """Raises KeyError, TypeError or ValueError for a report that is not one (or holds a
        negative or non-finite number: a report is a replica's word, not law)."""
        cost = cls(float(m["fixed_ms"]), float(m["per_decode_ms"]), float(m["per_prompt_ms"]), int(m["threads"]))
        numbers = (cost.fixed_ms, cost.per_decode_ms, cost.per_prompt_ms)
        if not all(math.isfinite(x) and x >= 0 for x in numbers) or cost.threads < 1:
            raise ValueError(f"not a step cost: {dict(m)!r}")
        return cost

    def token_ms(self) -> float:
        """CPU ms of one generated token of a sequence running alone."""
        return self.threads * (self.fixed_ms + self.per_decode_ms)


ROUTER_GEN_COST = GenCost(fixed_ms=6.0, per_decode_ms=3.5, per_prompt_ms=0.35, threads=2)
"""The price before any generator has reported: llama.cpp on the packaged GGUF at 2 threads,
measured on the 2-core build box of docs/generation.md (a slower CPU reports dearer)."""

STALE_MS = 120_000.0
"""A replica's report older than this is not used (a replica republishes every few seconds)."""

CHARS_PER_TOKEN = 3  # fewer characters per token than English averages: errs on the dear side
GROUNDING_TOKENS = 64  # what one non-text part adds to the prompt (labels, a transcript)


def estimate_prompt_tokens(text_chars: int, other_parts: int) -> int:
    """Prompt tokens of a request before tokenizing it (the router does not tokenize)."""
    return math.ceil(text_chars / CHARS_PER_TOKEN) + GROUNDING_TOKENS * other_parts + 32


def price_generate_ms(prompt_tokens: int, max_tokens: int, cost: GenCost = ROUTER_GEN_COST,
                      shared_by: int = 1) -> float:
    """CPU milliseconds a generate request may take: its prompt's prefill plus ``max_tokens``
    steps, times the engine's threads, each step's fixed cost shared with ``shared_by - 1``
    other sequences (1, the default: as if it ran alone; see the module docstring)."""
    return cost.threads * prompt_tokens * cost.per_prompt_ms + max_tokens * token_price_ms(cost, shared_by)


def token_price_ms(cost: GenCost, shared_by: int = 1) -> float:
    """What ``price_generate_ms`` charges for each output token: what a token the generator
    did not make gives back (``streams.stores.load_reports.take_gen_credits``)."""
    return cost.threads * (cost.fixed_ms / max(1, shared_by) + cost.per_decode_ms)


def costliest(reports: Mapping[str, Mapping[str, Any]], now_ms: float, stale_ms: float = STALE_MS,
              default: GenCost = ROUTER_GEN_COST) -> GenCost:
    """The dearest step cost among the fresh reports (replica -> report; a request may land
    on any replica), by the price of a token; ``default`` when none is fresh and readable (the
    router passes the last cost it used: a step cost does not go stale as a load does)."""
    fresh = []
    for m in reports.values():
        try:
            at = float(m["at"])
            cost = GenCost.from_map(m)
        except (KeyError, TypeError, ValueError):
            continue
        if now_ms - at <= stale_ms:
            fresh.append(cost)
    return max(fresh, key=lambda c: (c.token_ms(), c.threads * c.per_prompt_ms), default=default)
