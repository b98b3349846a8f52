"""Which tenant's queued items an engine takes first, weighted by what each item costs: one
tenant's backlog of costly items cannot put another tenant's cheap ones behind it. Pure: no
clock, no I/O.

Start-time fair queuing (Goyal, Vin and Cheng, SIGCOMM 1996) with tenants as the flows and
an item's predicted engine ms as its length. Each item gets a start tag when it is queued,

    start = max(V, finish[tenant]);  finish[tenant] = start + cost

and the queue is served in start-tag order (ties: arrival). ``V``, the virtual time, is the
start tag of the work the engine took last (the largest in its batch). So while two tenants both have work queued, each
gets about the same engine time, whatever their item sizes; a tenant that was idle starts at
``V`` (no credit for having been idle, no debt), that is, right after the work already being
served — one batch, not the other tenant's whole backlog.

A batcher that picks a batch out of order (length grouping) takes items by tag from the front
of this order; an item is never passed over by one queued after it from the same tenant, and
``V`` only grows, so every item is eventually taken while the number of tenants is bounded.

What this does not do: a client that may name any tenant (plaintext mode, where the
request's ``tenant`` field is believed) can start every request as a new tenant, at ``V``.
Fairness, like every per-tenant bound, holds between authenticated tenants.
"""

from __future__ import annotations

import bisect
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

MAX_TENANTS = 4096
"""Finish tags kept at most; past it those at or behind ``V`` (they no longer count) are dropped."""


class FairOrder(Generic[T]):
    """One lane's queue in fair order: ``push(tenant, cost, item)``, ``taken(items)`` after
    removing a batch, ``items`` the list the batcher reads (front first)."""

    def __init__(self, key: Callable[[T], tuple[float, int]]) -> None:
        self.virtual = 0.0
        self._finish: dict[str, float] = {}
        self._seq = 0
        self._key = key
        self.items: list[T] = []

    def tag(self, tenant: str, cost: float) -> tuple[float, int]:
        """The order key of a new item of ``tenant`` costing ``cost``: (start tag, arrival)."""
        start = max(self.virtual, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + max(0.0, cost)
        self._seq += 1
        if len(self._finish) > MAX_TENANTS:
            self._forget()
        return start, self._seq

    def _forget(self) -> None:
        """Drop the finish tags at or behind ``V`` (a tenant without one starts at ``V``
        anyway); if that is not enough, keep the half furthest ahead (the tenants with the
        most work queued; the rest lose at most what they have queued as credit)."""
        kept = {t: f for t, f in self._finish.items() if f > self.virtual}
        if len(kept) > MAX_TENANTS // 2:
            kept = dict(sorted(kept.items(), key=lambda tf: tf[1])[-(MAX_TENANTS // 2):])
        self._finish = kept

    def push(self, item: T) -> None:
        """Queue ``item`` (its key from ``tag``) at its place in the order."""
        bisect.insort(self.items, item, key=self._key)

    def taken(self, keys: list[tuple[float, int]]) -> None:
        """A batch of items with these keys left the queue: the virtual time moves to the
        last of them (the start tag of the work now in service; an item a length-grouped
        batch passed over keeps its place ahead of everything queued after it)."""
        if keys:
            self.virtual = max(self.virtual, max(k[0] for k in keys))

    def __len__(self) -> int:
        return len(self.items)
