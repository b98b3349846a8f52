"""How fast a stage reads one tenant's records while others are being served. Pure.

Where each tenant has its own input topics, a stage can hold one tenant's topics (pause them)
while it reads the others': the held tenant's records wait in its own topics (its consumer
lag) instead of in front of everyone's. ``Pacing`` is a token bucket per tenant in some unit,
refilled at ``rate`` per second up to a second's worth; a tenant that takes more than it holds
is held until its bucket has paid back what it owes (at most ``max_hold_s``): its records wait
in its topics, and those the stage had already read wait in the stage (it routes none of a
held tenant's records, ``RecordStage._turn``). Only while
another tenant's records came within ``window_s``: alone, a tenant is read as fast as it sends,
and a held tenant is taken again once the others' records stop coming. Memory: one entry per tenant
seen within ``window_s`` or still owing. Two units are paced:

- ``LargeRecordPacing``: bytes of large records (each over ``large_bytes``). A stage reads all
  its topics over one connection to each broker, one fetch in flight at a time: while a
  response carrying a tenant's megabyte requests is on its way, another tenant's record that
  arrived meanwhile waits for the next fetch. Measured under a flood of megabyte requests
  (docs/isolation.md, "Stop 51"): the victim's records waited longer the more bytes the
  flooding tenant could produce (route queue p95 18-19 ms at 2 MiB/s, 23-27 at 4, 26-42 at 8;
  8-10 alone), though every one of those requests was refused by its quota. Small records
  never count.
- refused records (the router's ``router.refused_per_s``): each request the router refuses
  for its tenant's own quota costs it and the broker about as much as one it routes (read,
  checked, answered). A tenant that ignores ``retry_after_ms`` and keeps sending is read at
  that many refusals a second while others are served (docs/isolation.md, "Stop 52").
"""

from __future__ import annotations

from typing import Iterable, Mapping


MAX_HOLD_S = 60.0
"""The longest one hold: what a tenant owes past it is forgiven. A held tenant's records wait
in its topics and come in one poll when it is taken again (up to 500 after a flood of small
ones), which the router then takes at 10 refusals a second (``RouterStage.turn_of``): up to
50 s; shorter caps measured worse (5 s, before the turns: a poll of its backlog every 5 s,
each one costing the others' records ~200 ms in the router's queue, docs/isolation.md,
"Stop 52"). A tenant alone is taken again at once."""


class Pacing:
    def __init__(self, rate_per_s: float, window_s: float = 1.0, max_hold_s: float = MAX_HOLD_S) -> None:
        if rate_per_s <= 0 or window_s <= 0 or max_hold_s <= 0:
            raise ValueError("pacing needs rate_per_s > 0, window_s > 0 and max_hold_s > 0")
        self.rate, self.window_s, self.max_hold_s = float(rate_per_s), window_s, max_hold_s
        self.burst = self.rate  # a second's worth
        self._tokens: dict[str, tuple[float, float]] = {}
        """Tenant -> (units it may take now, when that was computed)."""
        self._seen: dict[str, float] = {}
        """Tenant -> when its records last came (swept once a window)."""
        self._swept_at = 0.0

    def seen(self, tenants: Iterable[str], now: float) -> None:
        """Records of ``tenants`` came at ``now`` (s)."""
        for tenant in tenants:
            self._seen[tenant] = now

    def take(self, amounts: Mapping[str, float], now: float) -> dict[str, float]:
        """Take ``amounts`` (tenant -> units) from the tenants' buckets at ``now``; return the
        tenants to hold and until when."""
        holds: dict[str, float] = {}
        for tenant, amount in amounts.items():
            if amount <= 0:
                continue
            tokens = max(self.available(tenant, now) - amount, -self.max_hold_s * self.rate)
            self._tokens[tenant] = (tokens, now)
            if tokens < 0 and self.others_seen(tenant, now):
                holds[tenant] = now + -tokens / self.rate
        self._forget(now)
        return holds

    def available(self, tenant: str, now: float) -> float:
        """Units ``tenant`` may take now (negative: what it owes)."""
        tokens, at = self._tokens.get(tenant, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def others_seen(self, tenant: str, now: float) -> bool:
        """Whether another tenant's records came within the window (at most one more: the
        sweep runs once a window, so this stays constant time per call)."""
        self._forget(now)
        if len(self._seen) > 2 or (len(self._seen) == 2 and tenant in self._seen):
            return True
        return any(t != tenant and now - at <= self.window_s for t, at in self._seen.items())

    def _forget(self, now: float) -> None:
        if now - self._swept_at < self.window_s:
            return
        self._swept_at = now
        for t in [t for t, at in self._seen.items() if now - at > self.window_s]:
            del self._seen[t]
        for t in [t for t in self._tokens if self.available(t, now) >= self.burst]:
            del self._tokens[t]


class LargeRecordPacing(Pacing):
    def __init__(self, rate_bytes_per_s: float, large_bytes: int, window_s: float = 1.0) -> None:
        if large_bytes < 0:
            raise ValueError("pacing needs large_bytes >= 0")
        super().__init__(rate_bytes_per_s, window_s)
        self.large = large_bytes

    def polled(self, sizes: Mapping[str, Iterable[int]], now: float) -> dict[str, float]:
        """Note one poll's records (tenant -> their sizes in bytes) at ``now`` (s); return the
        tenants to hold and until when."""
        self.seen(sizes, now)
        return self.take({tenant: sum(n for n in these if n > self.large) for tenant, these in sizes.items()}, now)
