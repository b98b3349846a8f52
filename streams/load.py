"""What the router knows of the load downstream: queued engine work per stage, estimated
from consumer lag (records) x a cost per record, refreshed on a timer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from streams.lagmon import LagRow
from streams.policies.admission import CostModel
from workers import modalities


def units_per_record(modality: str) -> float:
    """Units of work one queued record of ``modality``'s encode topic stands for (its spec's
    ``units_per_record``: a text job ~20 tokens, a video job its frames); 1 when unknown."""
    spec = modalities.get(modality)
    return spec.units_per_record if spec is not None else 1.0


@dataclass
class LoadView:
    cost: CostModel = field(default_factory=CostModel)
    queued_ms: dict[str, float] = field(default_factory=dict)
    """Stage (``encode.<modality>``) -> estimated ms of engine work waiting there."""
    partition_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    """Encode topic -> partition -> estimated ms of work waiting there (for routing)."""

    def update(self, rows: Iterable[LagRow], topic_prefix: str) -> None:
        queued: dict[str, float] = {}
        by_partition: dict[str, dict[int, float]] = {}
        head = f"{topic_prefix}.encode."
        for row in rows:
            if not row.topic.startswith(head):
                continue
            modality = row.topic[len(head):].rsplit(".", 1)[0]
            work = row.lag * self.cost.cost_ms(modality, units_per_record(modality))
            stage = f"encode.{modality}"
            queued[stage] = queued.get(stage, 0.0) + work
            by_partition.setdefault(row.topic, {})[row.partition] = work
        self.queued_ms = queued
        self.partition_ms = by_partition

    @property
    def total_ms(self) -> float:
        return sum(self.queued_ms.values())
