"""Which partition of a pool's topic gets a job. Pure: load and randomness are passed in.

- ``least-loaded``: the partition with the least outstanding work — its lag at the last
  refresh (x cost per record) plus what this router has sent it since — so a replica that
  is behind gets less; the parts of one request go to distinct partitions while there are
  enough, so they run in parallel on different replicas. Ties break at random.
- ``spread``: consecutive partitions from a per-request hash (parallel parts, no load view).
- ``hash``: Kafka's key hash (None: the producer decides).
- ``round-robin``: one partition after the other.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Mapping

STRATEGIES = ("least-loaded", "spread", "hash", "round-robin")


@dataclass
class Partitioner:
    strategy: str = "least-loaded"
    rng: random.Random = field(default_factory=random.Random)
    _lag_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    _sent_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    _next: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"partitioner {self.strategy!r} is not one of {', '.join(STRATEGIES)}")

    def refresh(self, lag_ms: Mapping[str, Mapping[int, float]]) -> None:
        """New outstanding work per topic and partition (ms); forgets what was sent since."""
        self._lag_ms = {t: dict(p) for t, p in lag_ms.items()}
        self._sent_ms = {}

    def pick(self, topic: str, partitions: int, request_id: str, costs_ms: list[float]) -> list[int | None]:
        """A partition for each of one request's jobs on ``topic`` (with their own costs)."""
        n = len(costs_ms)
        if self.strategy == "hash":
            return [None] * n
        if self.strategy == "spread":
            start = zlib.crc32(request_id.encode()) % partitions
            return [(start + i) % partitions for i in range(n)]
        if self.strategy == "round-robin":
            start = self._next.get(topic, 0)
            self._next[topic] = (start + n) % partitions
            return [(start + i) % partitions for i in range(n)]
        lag = self._lag_ms.get(topic, {})
        sent = self._sent_ms.setdefault(topic, {})
        chosen: list[int | None] = []
        used: set[int] = set()
        for cost in costs_ms:
            candidates = [p for p in range(partitions) if p not in used] or list(range(partitions))
            load = {p: lag.get(p, 0.0) + sent.get(p, 0.0) for p in candidates}
            best = min(load.values())
            p = self.rng.choice([q for q in candidates if load[q] == best])
            chosen.append(p)
            used.add(p)
            sent[p] = sent.get(p, 0.0) + cost
        return chosen
