"""Which offsets a stage may commit, whatever order its work finishes in. Pure.

A stage takes records off a partition in offset order but finishes them in any order (a
batch of short texts overtakes a long one; a generation ends before an earlier one). Kafka
keeps one number per partition — "everything below this is done" — so the number a stage
commits must be the lowest offset it has taken and not finished yet (or, with nothing
unfinished, one past the last record it took). Committing anything higher would lose the
unfinished record on a crash; committing less only repeats finished work.

``OffsetTracker`` keeps, per partition, the offsets taken and not finished. ``take`` costs
O(log n), ``finish`` O(1), ``commit_point`` O(log n) amortized.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Hashable, Iterable


@dataclass
class _Partition:
    next_offset: int | None = None
    """One past the highest offset taken; None before the first record."""
    open: set[int] = field(default_factory=set)
    """Offsets taken and not finished."""
    heap: list[int] = field(default_factory=list)
    """The same offsets as a min-heap; finished ones are dropped lazily when they reach the top."""

    def lowest_open(self) -> int | None:
        while self.heap and self.heap[0] not in self.open:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None


class OffsetTracker:
    """Offsets taken and not yet finished, per partition key (a ``TopicPartition``)."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, _Partition] = {}

    def assign(self, tps: Iterable[Hashable]) -> None:
        """Start tracking ``tps`` from scratch (a new assignment)."""
        for tp in tps:
            self._parts[tp] = _Partition()

    def revoke(self, tps: Iterable[Hashable]) -> None:
        """Forget ``tps``: work on them that finishes later no longer counts here."""
        for tp in tps:
            self._parts.pop(tp, None)

    def take(self, tp: Hashable, offset: int) -> None:
        """Record that ``offset`` of ``tp`` is being worked on. Offsets of one partition
        must be taken in increasing order (as the consumer returns them)."""
        p = self._parts.setdefault(tp, _Partition())
        if p.next_offset is not None and offset < p.next_offset:
            raise ValueError(f"{tp}: offset {offset} taken after {p.next_offset - 1}")
        p.open.add(offset)
        heapq.heappush(p.heap, offset)
        p.next_offset = offset + 1

    def finish(self, tp: Hashable, offset: int) -> bool:
        """Record that ``offset`` is done (its outputs are with the broker). Returns False
        when ``tp`` is no longer tracked or the offset was never taken (a late finish after
        a revoke): nothing changes then."""
        p = self._parts.get(tp)
        if p is None or offset not in p.open:
            return False
        p.open.discard(offset)
        return True

    def commit_point(self, tp: Hashable) -> int | None:
        """The offset to commit for ``tp`` (Kafka's "next offset to read"), or None when
        nothing has been taken since the assignment."""
        p = self._parts.get(tp)
        if p is None or p.next_offset is None:
            return None
        low = p.lowest_open()
        return p.next_offset if low is None else low

    def unfinished(self, tp: Hashable) -> int:
        """How many records of ``tp`` are taken and not finished."""
        p = self._parts.get(tp)
        return 0 if p is None else len(p.open)

    def total_unfinished(self) -> int:
        return sum(len(p.open) for p in self._parts.values())
