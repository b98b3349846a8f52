"""What the router knows of the load downstream: queued engine work per stage, estimated
from consumer lag (records) x a cost per record, refreshed on a timer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from streams.lagmon import LagRow
from streams.policies.admission import CostModel

# Units of work one queued record stands for, per encode stage (a text job is ~20 tokens,
# an image job one image, a video job fans out to its frames).
UNITS_PER_RECORD = {"text": 20.0, "image": 1.0, "video": 16.0, "audio": 1.0}


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
            work = row.lag * self.cost.cost_ms(modality, UNITS_PER_RECORD.get(modality, 1.0))
            stage = f"encode.{modality}"
            queued[stage] = queued.get(stage, 0.0) + work
            by_partition.setdefault(row.topic, {})[row.partition] = work
        self.queued_ms = queued
        self.partition_ms = by_partition

    @property
    def total_ms(self) -> float:
        return sum(self.queued_ms.values())
