"""Micro-batching for encoders, with priority lanes.

Contract: a batch goes when it is full (``max_batch_size`` items or the cost budget), or
when its oldest item has waited ``max_wait_s``, whichever comes first. It never holds more
than ``max_batch_size`` items, and never more cost than ``max_batch_cost`` unless a single
item alone is over it (that item then runs alone rather than never). Items leave in
arrival order within a lane.

Lanes: ``rt`` is served before ``bulk``; when both have work, bulk still gets one batch
after ``rt_burst`` consecutive rt batches, so it is never starved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int = 16
    max_wait_s: float = 0.004
    max_batch_cost: float = float("inf")
    """Budget of one batch, in the unit of ``cost`` (padded tokens for text)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_wait_s < 0 or self.max_batch_cost <= 0:
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

    def next_batch(self, rt: Sequence[Pending[T]], bulk: Sequence[Pending[T]], now: float) -> Batch[T] | Wait | None:
        """Return the batch to run now, a ``Wait`` until the next one is due, or None when idle.

        The caller removes the returned items (a prefix of that lane's queue) from its queue.
        """
        lane, queue = self._pick_lane(rt, bulk)
        if queue is None:
            return None
        items = self._fill(queue)
        full = (len(items) == self.limits.max_batch_size or len(items) < len(queue)
                or self.batch_cost([p.cost for p in items]) >= self.limits.max_batch_cost)
        due_at = queue[0].enqueued_at + self.limits.max_wait_s
        if not full and now < due_at:
            return Wait(due_at)
        # The streak counts rt batches that went ahead of waiting bulk work.
        self._rt_streak = self._rt_streak + 1 if lane == "rt" and bulk else 0
        return Batch(lane, items)

    def _pick_lane(self, rt: Sequence[Pending[T]], bulk: Sequence[Pending[T]]):
        if rt and bulk:
            return ("bulk", bulk) if self._rt_streak >= self.rt_burst else ("rt", rt)
        if rt:
            return "rt", rt
        if bulk:
            return "bulk", bulk
        return None, None

    def _fill(self, queue: Sequence[Pending[T]]) -> list[Pending[T]]:
        taken: list[Pending[T]] = []
        costs: list[float] = []
        for p in queue:
            if len(taken) == self.limits.max_batch_size:
                break
            if taken and self.batch_cost(costs + [p.cost]) > self.limits.max_batch_cost:
                break
            taken.append(p)
            costs.append(p.cost)
        return taken
