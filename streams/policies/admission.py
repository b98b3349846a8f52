"""Cost-aware admission with priority lanes, and lag backpressure. Pure: plain data in,
a decision out; the router measures, asks, and carries the decision out.

The router knows, per encode stage, what a new part would wait (``queued_ms``: the queued
engine work the stage's replicas report, plus what the router sent since — see
``streams.policies.load``) and what each part of the request costs there (its length's cost from
the same reports, or its modality's default before any report). A request is admitted when
every stage it needs is under that lane's limit; bulk's limit is lower than rt's, so bulk is
shed first, with ``overloaded`` and how long to wait (``retry_after_ms``: the time the
queue needs to drain below the limit). A request whose predicted wait plus own cost already
exceeds its deadline is rejected early with ``deadline_exceeded`` rather than dropped late.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from schemas.errors import ErrorCode


@dataclass(frozen=True, slots=True)
class Admit:
    predicted_wait_ms: float


@dataclass(frozen=True, slots=True)
class Reject:
    code: ErrorCode
    message: str
    retry_after_ms: int | None
    stage: str | None = None
    """The stage whose queue refused it (``overloaded``)."""


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_queued_ms_rt: float = 5_000.0
    """Queued work (ms) past which a stage refuses new rt requests."""
    max_queued_ms_bulk: float = 1_000.0
    """Queued work (ms) past which a stage refuses new bulk requests (lower: bulk is shed first)."""
    min_retry_after_ms: int = 200


def admit(*, lane: str, stages: Mapping[str, float], queued_ms: Mapping[str, float], deadline_ms: float,
          limits: AdmissionLimits) -> Admit | Reject:
    """Decide on one request.

    ``stages``: the request's own cost (ms) at each stage it needs; ``queued_ms``: the work
    already queued at each stage. A request is admitted into a stage only while the queued
    work plus its own stays within its lane's limit, so one costly request cannot push the
    stage past the bound that every request behind it was promised; one costlier than the
    whole limit gets in only while the stage is nearly idle (under ``IDLE_SHARE`` of the
    limit queued): under traffic that keeps the stage busier than that it is refused each
    time (``overloaded`` with a retry-after), and belongs on the bulk lane.
    """
    limit = limits.max_queued_ms_rt if lane == "rt" else limits.max_queued_ms_bulk
    worst_stage, worst_over = None, 0.0
    for stage, own in stages.items():
        queued = queued_ms.get(stage, 0.0)
        over = queued + own - limit
        if (queued >= limit or (over > 0 and queued >= IDLE_SHARE * limit)) and \
                (worst_stage is None or over > worst_over):
            worst_stage, worst_over = stage, max(over, 0.0)
    if worst_stage is not None:
        retry = max(limits.min_retry_after_ms, int(worst_over) + limits.min_retry_after_ms)
        return Reject(ErrorCode.OVERLOADED,
                      f"stage {worst_stage} has {queued_ms.get(worst_stage, 0.0):.0f} ms of work queued and this "
                      f"request needs {stages[worst_stage]:.0f} ms more (limit for {lane}: {limit:.0f} ms); retry later",
                      retry, worst_stage)
    wait = max((queued_ms.get(s, 0.0) for s in stages), default=0.0)
    own = max(stages.values(), default=0.0)
    if wait + own > deadline_ms:
        return Reject(ErrorCode.DEADLINE_EXCEEDED,
                      f"predicted {wait + own:.0f} ms (queued {wait:.0f} + own {own:.0f}) exceeds the deadline of "
                      f"{deadline_ms:.0f} ms", None)
    return Admit(wait)


IDLE_SHARE = 0.2
"""A stage with less than this share of its lane's limit queued counts as idle for a request
that alone costs more than the limit (it may wait that long; what comes after it waits for it
to finish). Not less: what the router sees of a long batch is a report made while it ran, of
what was left of its prediction. A batch that ends early leaves that difference counted until
the next report, and a clip of 1.45 s predicted ends 50-150 ms either side of it. At 5% (25 ms
of rt's 500) a client's next clip, sent on its last one's answer, was refused behind it."""


@dataclass
class Backpressure:
    """Hysteresis on queued work: pause bulk ingress above ``high_ms``, resume under ``low_ms``."""

    high_ms: float = 2_000.0
    low_ms: float = 500.0
    paused: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.low_ms < self.high_ms:
            raise ValueError("backpressure needs 0 <= low_ms < high_ms")

    def update(self, queued_ms: float) -> str | None:
        """'pause', 'resume' or None (no change) for the current total queued work."""
        if not self.paused and queued_ms > self.high_ms:
            self.paused = True
            return "pause"
        if self.paused and queued_ms < self.low_ms:
            self.paused = False
            return "resume"
        return None
