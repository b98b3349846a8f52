"""Which held job a single worker takes next, so one tenant's burst cannot stall the others:
rt before bulk (bulk is never starved: one in ``BULK_EVERY`` takes goes to bulk while both
wait), and within a lane one job per tenant in turn (round robin over the tenants that have
work waiting, each tenant's jobs in arrival order). Pure: no clock, no I/O.

Memory: what is pushed is held until popped; the caller bounds how much it pushes (the video
stage holds at most ``video.max_held`` jobs).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")

BULK_EVERY = 8
"""While rt and bulk both wait, every eighth take is bulk's."""


class FairQueue(Generic[T]):
    """``push(lane, tenant, item)``, ``pop() -> item`` (``IndexError`` when empty), ``len``."""

    def __init__(self) -> None:
        self._lanes: dict[str, OrderedDict[str, deque[T]]] = {"rt": OrderedDict(), "bulk": OrderedDict()}
        self._size = 0
        self._rt_run = 0

    def push(self, lane: str, tenant: str, item: T) -> None:
        tenants = self._lanes["bulk" if lane == "bulk" else "rt"]
        tenants.setdefault(tenant, deque()).append(item)
        self._size += 1

    def pop(self) -> T:
        rt, bulk = self._lanes["rt"], self._lanes["bulk"]
        if not rt and not bulk:
            raise IndexError("pop from an empty FairQueue")
        take_bulk = not rt or (bulk and self._rt_run >= BULK_EVERY - 1)
        self._rt_run = 0 if take_bulk else self._rt_run + 1
        tenants = bulk if take_bulk else rt
        tenant, jobs = next(iter(tenants.items()))
        item = jobs.popleft()
        del tenants[tenant]  # to the back of the turn, or gone when it has nothing left
        if jobs:
            tenants[tenant] = jobs
        self._size -= 1
        return item

    def __len__(self) -> int:
        return self._size
