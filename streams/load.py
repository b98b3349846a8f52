"""What the router knows of the load downstream, from the encoders' own reports. Pure.

Every encoder replica reports a few times a second (``streams.costs.publish_load``) what it
holds: the engine work queued in it (milliseconds, predicted by its batch cost model, plus
the records not yet fetched), per partition, and what one more item costs it by length. It
knows this exactly; the router could only guess it from consumer lag. Between two reports
the router adds what it sent itself, so a burst cannot all be admitted on one stale number.

``wait_ms(stage)`` is what a new part would wait: the least-loaded replica's queue (the
partitioner sends the part there). ``item_ms(stage, length)`` is what the part itself
costs. Reports older than ``stale_ms`` are ignored (a replica gone, Redis away): with none
left, a stage counts as idle and the encoders' own deadline checks remain.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

@dataclass
class Report:
    stage: str
    replica: str
    at_ms: float
    queued_ms: float
    partitions: dict[str, dict[int, float]]
    """Topic -> partition -> ms queued from it."""
    item_ms: list[tuple[float, float]]
    """(length, ms one item of that length costs), sorted by length."""

    @classmethod
    def from_map(cls, key: str, m: Mapping[str, Any]) -> "Report":
        parts: dict[str, dict[int, float]] = {}
        for tp, ms in (m.get("partitions") or {}).items():
            topic, _, p = str(tp).rpartition(":")
            parts.setdefault(topic, {})[int(p)] = float(ms)
        return cls(stage=str(m["stage"]), replica=key, at_ms=float(m["at"]), queued_ms=float(m["queued_ms"]),
                   partitions=parts, item_ms=sorted((float(k), float(v)) for k, v in (m.get("item_ms") or {}).items()))

    def cost(self, length: float) -> float | None:
        if not self.item_ms:
            return None
        lengths = [k for k, _ in self.item_ms]
        i = min(bisect.bisect_left(lengths, length), len(lengths) - 1)
        return self.item_ms[i][1] * max(1.0, length / lengths[i]) if length > lengths[-1] else self.item_ms[i][1]


@dataclass
class LoadView:
    stale_ms: float = 3_000.0
    reports: dict[str, Report] = field(default_factory=dict)
    sent_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    """Topic -> partition -> ms the router sent there since the last reports."""

    def update_reports(self, raw: Mapping[str, Mapping[str, Any]], now_ms: float) -> None:
        fresh = {}
        for key, m in raw.items():
            try:
                report = Report.from_map(key, m)
            except (KeyError, TypeError, ValueError):
                continue
            if now_ms - report.at_ms <= self.stale_ms:
                fresh[key] = report
        self.reports = fresh
        self.sent_ms = {}

    def note_sent(self, topic: str, partition: int | None, ms: float) -> None:
        p = -1 if partition is None else partition
        by = self.sent_ms.setdefault(topic, {})
        by[p] = by.get(p, 0.0) + ms

    def _replicas(self, stage: str) -> list[Report]:
        return [r for r in self.reports.values() if r.stage == stage]

    def wait_ms(self, stage: str) -> float:
        replicas = self._replicas(stage)
        if not replicas:
            return sum(sum(by.values()) for t, by in self.sent_ms.items() if _stage_of(t) == stage)
        best = float("inf")
        for r in replicas:
            mine = {(t, p) for t, by in r.partitions.items() for p in by}
            sent = sum(ms for t, by in self.sent_ms.items() for p, ms in by.items() if (t, p) in mine)
            best = min(best, r.queued_ms + sent)
        return best

    def item_ms(self, stage: str, length: float) -> float | None:
        """What one item of ``length`` costs at ``stage``, from its freshest report; None
        before any report (the caller falls back to the modality's default cost)."""
        for r in sorted(self._replicas(stage), key=lambda r: -r.at_ms):
            cost = r.cost(length)
            if cost is not None:
                return cost
        return None

    @property
    def queued_ms(self) -> dict[str, float]:
        stages = {r.stage for r in self.reports.values()} | {_stage_of(t) for t in self.sent_ms}
        return {s: self.wait_ms(s) for s in stages}

    @property
    def total_ms(self) -> float:
        return sum(r.queued_ms for r in self.reports.values()) + sum(sum(b.values()) for b in self.sent_ms.values())

    @property
    def partition_ms(self) -> dict[str, dict[int, float]]:
        """Topic -> partition -> ms waiting there (for the least-loaded partitioner)."""
        out: dict[str, dict[int, float]] = {}
        for r in self.reports.values():
            for topic, by in r.partitions.items():
                for p, ms in by.items():
                    out.setdefault(topic, {})[p] = out.get(topic, {}).get(p, 0.0) + ms
        for topic, by in self.sent_ms.items():
            for p, ms in by.items():
                if p >= 0:
                    out.setdefault(topic, {})[p] = out.get(topic, {}).get(p, 0.0) + ms
        return out


def _stage_of(topic: str) -> str:
    """``<prefix>.encode.<modality>.<lane>`` -> ``encode.<modality>``."""
    parts = topic.split(".")
    return f"encode.{parts[-2]}" if len(parts) >= 3 and parts[-3] == "encode" else topic


def merge_item_costs(rows: Iterable[tuple[float, float]]) -> dict[str, float]:
    """A report's ``item_ms`` map from (length, ms) rows."""
    return {f"{length:g}": round(ms, 4) for length, ms in rows}
