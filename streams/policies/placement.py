"""Placement: which of a router's encode jobs the encoder running in its own process takes
(``router.colocate``). Pure: the encoder's state in, one decision per job out.

A job taken in process skips a broker hop each way of its trip to the pool: at light load
that hop is most of what the pipeline adds to a request. It is taken while the encoder has
room (``room``: jobs it may still hold), the predicted engine work ahead of it in its lane
is at most ``max_queued_ms`` and its own is at most ``max_part_ms``; past either, it goes
through the encode topic to the whole pool, so a busy router's encoder never becomes the
queue the pool would have drained, and a costly part (a long text) never runs in the
process that routes every tenant's requests. The two bounds are apart so that 0 queued
means "only while idle" for parts of any size the router may run. rt goes ahead of bulk: an rt job waits for the rt work queued, a bulk
job for all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class Offer:
    lane: str
    """``rt`` or ``bulk``."""
    cost_ms: float
    """Its predicted engine time."""


def take_local(offers: Sequence[Offer], queued_rt_ms: float, queued_bulk_ms: float, room: int,
               max_queued_ms: float, max_part_ms: float) -> list[bool]:
    """Per offer, in order, whether the co-located encoder takes it. ``queued_rt_ms`` and
    ``queued_bulk_ms``: the predicted work ahead of a new job of each lane now."""
    queued = {"rt": queued_rt_ms, "bulk": queued_bulk_ms}
    taken: list[bool] = []
    for offer in offers:
        lane = "bulk" if offer.lane == "bulk" else "rt"
        if room <= 0 or queued[lane] > max_queued_ms or offer.cost_ms > max_part_ms:
            taken.append(False)
            continue
        taken.append(True)
        room -= 1
        queued["bulk"] += offer.cost_ms  # every job goes ahead of a bulk job that comes after it
        if lane == "rt":
            queued["rt"] += offer.cost_ms
    return taken
