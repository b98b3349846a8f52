"""Micro-batching for encoders, with priority lanes and length-aware grouping. Pure.

Contract: a batch goes when it is full (``max_batch_size`` items, or the next item would
take its padded cost over ``max_batch_cost``), or when the oldest item of its lane has waited
``max_wait_s``, whichever comes first. It never holds more than ``max_batch_size`` items,
and never more padded cost than ``max_batch_cost`` unless a single item alone is over it
(that item then runs alone rather than never). Every item is eventually taken: the oldest
item of a lane is always in the batch that goes when its wait is up.

Which items ride together (``grouping``):

- ``fifo``: a prefix of the lane's queue, in arrival order (what a generic server does).
- ``length``: items whose costs (padded lengths: tokens for text) are within
  ``length_ratio`` of each other, closest to the batch's anchor first. A batch is padded to
  its longest item, so one 250-token text among fifteen 15-token ones makes all sixteen cost
  250 tokens; grouped by length, the short ones ride together and the long one runs with its
  peers. The anchor is the oldest item when its wait is up; before that, any group that is
  already full may go first (the engine stays busy; the oldest goes within ``max_wait_s``).

Lanes: ``rt`` is served before ``bulk``; when both have work, bulk still gets one batch
after ``rt_burst`` consecutive rt batches, so it is never starved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")

GROUPINGS = ("fifo", "length")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int = 16
    max_wait_s: float = 0.004
    max_batch_cost: float = float("inf")
    """Budget of one batch, in the unit of ``cost`` (padded tokens for text)."""
    grouping: str = "fifo"
    length_ratio: float = 2.0
    """``length`` grouping: the longest item of a batch is at most this times its shortest."""
    scan: int = 64
    """``length`` grouping: how many of a lane's oldest items are considered for one batch."""

    def __post_init__(self) -> None:
        if (self.max_batch_size < 1 or self.max_wait_s < 0 or self.max_batch_cost <= 0
                or self.grouping not in GROUPINGS or self.length_ratio < 1 or self.scan < 1):
            raise ValueError(f"invalid batch limits {self}")


@dataclass(frozen=True, slots=True)
class Pending(Generic[T]):
    item: T
    cost: float
    """This item's own cost (its token count for text)."""
    enqueued_at: float
    """Monotonic seconds when the item reached the worker."""


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    lane: str
    items: list[Pending[T]]
    """In queue order; not always a prefix of the queue (``length`` grouping)."""


@dataclass(frozen=True, slots=True)
class Wait:
    until: float
    """Monotonic time at which the next batch is due even with no new arrivals."""


def padded_cost(costs: Sequence[float]) -> float:
    """Cost of running items together when each is padded to the longest: rows x longest."""
    return len(costs) * max(costs) if costs else 0.0


class MicroBatcher(Generic[T]):
    """Decides which lane runs next and which of its items ride together."""

    def __init__(self, limits: BatchLimits, rt_burst: int = 4,
                 batch_cost: Callable[[Sequence[float]], float] = padded_cost) -> None:
        if rt_burst < 1:
            raise ValueError("rt_burst must be >= 1")
        self.limits = limits
        self.rt_burst = rt_burst
        self.batch_cost = batch_cost
        self._rt_streak = 0

    def next_batch(self, rt: Sequence[Pending[T]], bulk: Sequence[Pending[T]], now: float,
                   max_wait_s: float | None = None) -> Batch[T] | Wait | None:
        """Return the batch to run now, a ``Wait`` until the next one is due, or None when idle.

        ``max_wait_s`` overrides the limits' wait for this decision (0: a batch goes at once
        with what is there, for an engine that company does not make cheaper). The caller
        removes the returned items from that lane's queue.
        """
        lane, queue = self._pick_lane(rt, bulk)
        if queue is None:
            return None
        wait = self.limits.max_wait_s if max_wait_s is None else max_wait_s
        due_at = queue[0].enqueued_at + wait
        if self.limits.grouping == "fifo":
            items, full = self._fill(queue, list(range(len(queue))))
            chosen = items if full or now >= due_at else None
        else:
            chosen = self._by_length(queue, now >= due_at)
        if chosen is None:
            return Wait(due_at)
        # The streak counts rt batches that went ahead of waiting bulk work.
        self._rt_streak = self._rt_streak + 1 if lane == "rt" and bulk else 0
        return Batch(lane, [queue[i] for i in chosen])

    def _pick_lane(self, rt: Sequence[Pending[T]], bulk: Sequence[Pending[T]]):
        if rt and bulk:
            return ("bulk", bulk) if self._rt_streak >= self.rt_burst else ("rt", rt)
        if rt:
            return "rt", rt
        if bulk:
            return "bulk", bulk
        return None, None

    def _fill(self, queue: Sequence[Pending[T]], order: Sequence[int],
              ratio: float | None = None) -> tuple[list[int], bool]:
        """Take items in ``order`` while the limits allow (and, with ``ratio``, while the
        longest stays within ``ratio`` of the shortest); (indices in queue order, full)."""
        taken: list[int] = []
        costs: list[float] = []
        for i in order:
            c = queue[i].cost
            if len(taken) == self.limits.max_batch_size:
                return sorted(taken), True
            if ratio is not None and costs and max(max(costs), c) > ratio * max(min(min(costs), c), 1e-9):
                continue
            if taken and self.batch_cost(costs + [c]) > self.limits.max_batch_cost:
                return sorted(taken), True
            taken.append(i)
            costs.append(c)
        full = len(taken) == self.limits.max_batch_size or self.batch_cost(costs) >= self.limits.max_batch_cost
        return sorted(taken), full

    def _by_length(self, queue: Sequence[Pending[T]], oldest_due: bool) -> list[int] | None:
        window = range(min(len(queue), self.limits.scan))
        grouped: set[int] = set()
        for anchor in window:
            if anchor in grouped:
                continue
            members, full = self._fill(queue, self._similar(queue, anchor, window), self.limits.length_ratio)
            if full or (anchor == 0 and oldest_due):
                return members
            grouped.update(members)
        return None

    def _similar(self, queue: Sequence[Pending[T]], anchor: int, window: range) -> list[int]:
        """The anchor, then the items within ``length_ratio`` of it, closest in length first
        (older first among equals)."""
        a = max(queue[anchor].cost, 1e-9)
        limit = math.log(self.limits.length_ratio) + 1e-12
        near = []
        for i in window:
            if i == anchor:
                continue
            distance = abs(math.log(max(queue[i].cost, 1e-9) / a))
            if distance <= limit:
                near.append((distance, i))
        near.sort()
        return [anchor, *(i for _, i in near)]
