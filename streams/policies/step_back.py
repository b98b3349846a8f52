"""When a router run ahead of the others for the CPU gives its priority back. Pure: the
router tells it each request admission refused for want of capacity, and asks it whether to
run raised now.

A router raised above the pools (``local.nice``, e.g. ``router=-10``) keeps the interactive
path quick while heavy work runs beside it: another tenant's flood, which its quotas shed,
cannot push the router's own encoder off the cores (docs/isolation.md, stop 44). Past the
box's capacity the same raise does harm: the router's work grows with what arrives, shed or
not, and ahead of the pools it takes the cores the admitted requests wait for (receive
livelock; docs/capacity.md, stop 44).

The two are told apart by why requests are refused. A tenant past its share is shed by its
quota, and the engines keep room for the others; a box past capacity shows as admission
refusing requests because a stage's queued work is past its lane's limit (``overloaded``,
not a quota). So: ``rate_per_s`` or more capacity refusals within one second, and the
router steps back to its place beside the others; it takes the raise again once a whole
``hold_s`` passed without such a second.
"""

from __future__ import annotations

import math
from collections import deque


class StepBack:
    """Raised until capacity refusals reach ``rate_per_s`` within a second; back to the
    others' level until ``hold_s`` passed without that. ``rate_per_s`` 0: never steps back."""

    def __init__(self, rate_per_s: float, hold_s: float) -> None:
        if rate_per_s < 0 or hold_s < 0:
            raise ValueError("step-back needs rate_per_s >= 0 and hold_s >= 0")
        self.rate_per_s, self.hold_s = rate_per_s, hold_s
        # The last ``rate_per_s`` refusals are all it needs to tell whether that many fell
        # within one second: memory is bounded by the threshold, not by the traffic.
        self._recent: deque[float] = deque(maxlen=max(1, math.ceil(rate_per_s)))
        self._over_at: float | None = None
        self.raised = True

    def refused(self, now_s: float) -> None:
        """A request admission refused for want of capacity (not a tenant's quota), at ``now_s``."""
        if self.rate_per_s <= 0:
            return
        self._recent.append(now_s)
        if len(self._recent) == self._recent.maxlen and now_s - self._recent[0] < 1.0:
            self._over_at = now_s

    def update(self, now_s: float) -> bool | None:
        """Whether to run raised now, when that changes; None when it stays as it is."""
        raised = self._over_at is None or now_s - self._over_at >= self.hold_s
        if raised == self.raised:
            return None
        self.raised = raised
        return raised
