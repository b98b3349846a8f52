"""Where a request's time went: one span per stage it passed through.

A span is ``[stage, queued_at_ms, started_at_ms, finished_at_ms]`` in Unix epoch
milliseconds (wall clock, because spans are written by different processes). Queue time
of a stage is ``started - queued`` (broker hop plus waiting in the consumer), service time
is ``finished - started``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable


def now_ms() -> float:
    """Wall-clock epoch milliseconds: comparable across processes on synchronised hosts."""
    return time.time() * 1000.0


@dataclass(frozen=True, slots=True)
class Span:
    stage: str
    queued_at_ms: float
    started_at_ms: float
    finished_at_ms: float

    @property
    def queued_ms(self) -> float:
        return max(0.0, self.started_at_ms - self.queued_at_ms)

    @property
    def service_ms(self) -> float:
        return max(0.0, self.finished_at_ms - self.started_at_ms)

    def to_wire(self) -> list[Any]:
        return [self.stage, round(self.queued_at_ms, 3), round(self.started_at_ms, 3), round(self.finished_at_ms, 3)]

    @classmethod
    def from_wire(cls, raw: Any) -> "Span":
        stage, q, s, f = raw
        return cls(str(stage), float(q), float(s), float(f))


def spans_from_wire(raw: Iterable[Any] | None) -> list[Span]:
    return [Span.from_wire(s) for s in (raw or [])]


def breakdown(spans: Iterable[Span]) -> list[dict[str, Any]]:
    """Per-stage queued and service milliseconds, in the order the stages ran."""
    return [
        {"stage": s.stage, "queued_ms": round(s.queued_ms, 3), "service_ms": round(s.service_ms, 3)}
        for s in sorted(spans, key=lambda s: s.started_at_ms)
    ]
