"""What the router knows of the load downstream, from the encoders' own reports. Pure.

Every encoder replica reports a few times a second (``streams.costs.publish_load``) what it
holds: the engine work queued in it (milliseconds, predicted by its batch cost model, plus
the records not yet fetched), per partition, and what one more item costs it by length. It
knows this exactly; the router could only guess it from consumer lag. On top of a report the
router adds what it sent itself after that report was made (less ``fetch_lag_ms``: what the
encoder has surely fetched by then is in its report), so a burst cannot all be admitted on
one stale number.

``wait_ms(stage, lane)`` is what a new part would wait: the least-loaded replica's queue (the
partitioner sends the part there) — for ``rt``, only the rt work queued there and the batch
running (an encoder serves rt before bulk); for ``bulk``, all of it. ``item_ms(stage, length)`` is what the part itself
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
    """All the work this replica holds (ms)."""
    queued_rt_ms: float
    """What an rt item waits behind here: the batch running plus the rt work queued (ms)."""
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
                   queued_rt_ms=float(m.get("queued_rt_ms", m["queued_ms"])), partitions=parts, item_ms=sorted((float(k), float(v)) for k, v in (m.get("item_ms") or {}).items()))

    def cost(self, length: float) -> float | None:
        if not self.item_ms:
            return None
        lengths = [k for k, _ in self.item_ms]
        i = min(bisect.bisect_left(lengths, length), len(lengths) - 1)
        return self.item_ms[i][1] * max(1.0, length / lengths[i]) if length > lengths[-1] else self.item_ms[i][1]


@dataclass(frozen=True, slots=True)
class Sent:
    at_ms: float
    topic: str
    partition: int
    ms: float


@dataclass
class LoadView:
    stale_ms: float = 3_000.0
    fetch_lag_ms: float = 100.0
    """Records sent this long before a report are assumed to be in it (fetched by then)."""
    reports: dict[str, Report] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    """What the router sent and no report can have counted yet, oldest first."""

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
        oldest = min((r.at_ms for r in fresh.values()), default=now_ms - self.stale_ms)
        self.sent = [x for x in self.sent if x.at_ms > oldest - self.fetch_lag_ms]

    def note_sent(self, topic: str, partition: int | None, ms: float, now_ms: float) -> None:
        self.sent.append(Sent(now_ms, topic, -1 if partition is None else partition, ms))

    @property
    def sent_ms(self) -> dict[str, dict[int, float]]:
        """Topic -> partition -> ms sent that no report holds yet."""
        out: dict[str, dict[int, float]] = {}
        for x in self.sent:
            by = out.setdefault(x.topic, {})
            by[x.partition] = by.get(x.partition, 0.0) + x.ms
        return out

    def _sent_since(self, report: Report | None, counted: Any) -> float:
        since = -float("inf") if report is None else report.at_ms - self.fetch_lag_ms
        mine = None if report is None else {(t, p) for t, by in report.partitions.items() for p in by}
        return sum(x.ms for x in self.sent if x.at_ms > since and counted(x.topic)
                   and (mine is None or (x.topic, x.partition) in mine or x.partition < 0))

    def _replicas(self, stage: str) -> list[Report]:
        return [r for r in self.reports.values() if r.stage == stage]

    def wait_ms(self, stage: str, lane: str = "bulk") -> float:
        def counted(topic: str) -> bool:
            return _stage_of(topic) == stage and (lane != "rt" or topic.endswith(".rt"))

        replicas = self._replicas(stage)
        if not replicas:
            return self._sent_since(None, counted)
        return min((r.queued_rt_ms if lane == "rt" else r.queued_ms) + self._sent_since(r, counted) for r in replicas)

    def item_ms(self, stage: str, length: float) -> float | None:
        """What one item of ``length`` costs at ``stage``, from its freshest report; None
        before any report (the caller falls back to the modality's default cost)."""
        for r in sorted(self._replicas(stage), key=lambda r: -r.at_ms):
            cost = r.cost(length)
            if cost is not None:
                return cost
        return None

    def queued_ms(self, lane: str = "bulk") -> dict[str, float]:
        """Stage -> what a new ``lane`` part would wait there (ms)."""
        stages = {r.stage for r in self.reports.values()} | {_stage_of(t) for t in self.sent_ms}
        return {s: self.wait_ms(s, lane) for s in stages}

    @property
    def total_ms(self) -> float:
        return sum(r.queued_ms for r in self.reports.values()) + sum(x.ms for x in self.sent)

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
