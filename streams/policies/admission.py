"""Cost-aware admission with priority lanes, and lag backpressure. Pure: plain data in,
a decision out; the router measures, asks, and carries the decision out.

Cost model: each part's compute in milliseconds of engine time, estimated from what the
router can see without decoding — each modality's spec (``workers/modalities``) says how
many units a part is (tokens ≈ characters / 4 for text, one per image, ``max_frames`` image
units for a video, one per audio clip) and what a unit costs before anything is measured;
the coefficients then follow observed service times (EWMA).

Queued work of a stage = its consumer lag (records) x the mean cost of one of its records.
A request is admitted when, for every stage it needs, the stage's queued work is under
that lane's limit; bulk's limit is lower than rt's, so bulk is shed first. A request whose
predicted wait plus own cost already exceeds its deadline is rejected early with
``deadline_exceeded`` rather than dropped late.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from schemas.errors import ErrorCode
from workers import modalities

DEFAULT_MS_PER_UNIT = 10.0
"""Cost of one unit of a modality nobody registered (the baseline's ``any`` pool)."""


def default_ms_per_unit() -> dict[str, float]:
    """Each registered modality's cost of one unit before any worker has measured it."""
    return {s.name: s.ms_per_unit for s in modalities.specs()}


@dataclass(frozen=True, slots=True)
class Admit:
    predicted_wait_ms: float


@dataclass(frozen=True, slots=True)
class Reject:
    code: ErrorCode
    message: str
    retry_after_ms: int | None


@dataclass
class CostModel:
    """Milliseconds of engine time per unit of each modality, kept current by ``observe``."""

    ms_per_unit: dict[str, float] = field(default_factory=default_ms_per_unit)
    alpha: float = 0.1
    """EWMA weight of a new observation."""

    def units(self, modality: str, size: int, max_frames: int = 16) -> float:
        """Work units of one part as its modality's spec counts them (1 for an unknown one):
        ``size`` is the text's characters or the inline bytes."""
        spec = modalities.get(modality)
        return spec.units(size, max_frames) if spec is not None else 1.0

    def cost_ms(self, modality: str, units: float) -> float:
        return self.ms_per_unit.get(modality, DEFAULT_MS_PER_UNIT) * units

    def observe(self, modality: str, units: float, service_ms: float) -> None:
        if units <= 0 or service_ms < 0:
            return
        seen = service_ms / units
        old = self.ms_per_unit.get(modality, seen)
        self.ms_per_unit[modality] = (1 - self.alpha) * old + self.alpha * seen


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
    already queued at each stage. Never admits a request into a stage over its lane's limit.
    """
    limit = limits.max_queued_ms_rt if lane == "rt" else limits.max_queued_ms_bulk
    worst_stage, worst_over = None, 0.0
    for stage in stages:
        over = queued_ms.get(stage, 0.0) - limit
        if over > worst_over or (over >= 0 and worst_stage is None):
            worst_stage, worst_over = stage, max(over, 0.0)
    if worst_stage is not None and queued_ms.get(worst_stage, 0.0) >= limit:
        retry = max(limits.min_retry_after_ms, int(worst_over) + limits.min_retry_after_ms)
        return Reject(ErrorCode.OVERLOADED,
                      f"stage {worst_stage} has {queued_ms[worst_stage]:.0f} ms of work queued (limit for {lane}: "
                      f"{limit:.0f} ms); retry later", retry)
    wait = max((queued_ms.get(s, 0.0) for s in stages), default=0.0)
    own = max(stages.values(), default=0.0)
    if wait + own > deadline_ms:
        return Reject(ErrorCode.DEADLINE_EXCEEDED,
                      f"predicted {wait + own:.0f} ms (queued {wait:.0f} + own {own:.0f}) exceeds the deadline of "
                      f"{deadline_ms:.0f} ms", None)
    return Admit(wait)


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
