"""How fast a stage reads one tenant's large records while others are being served. Pure.

A stage reads all its topics over one connection to each broker, one fetch in flight at a
time: while a response carrying a tenant's megabyte requests is on its way (the broker
encrypts it, the stage decrypts and parses it), another tenant's record that arrived meanwhile
waits for the next fetch. Measured under a flood of megabyte requests (docs/isolation.md,
"Stop 51"): the victim's records waited longer the more bytes the flooding tenant could
produce (route queue p95 18-19 ms at 2 MiB/s, 23-27 at 4, 26-42 at 8; 8-10 alone), though
every one of those requests was refused by its quota.

``LargeRecordPacing`` bounds the bytes of large records (each over ``large_bytes``) a stage
takes per tenant per second (``rate_bytes_per_s``, up to a second's worth at once): past
that, the stage holds the tenant's topics (pauses them) until its bucket has paid back what
it took, and the rest waits in the tenant's own topics (its consumer lag) instead of in front
of the others. Only while another tenant's records came within ``window_s``: alone, a tenant's
large records are read as fast as they come. Small records never count. Memory: one entry per
tenant seen within ``window_s`` or still owing.
"""

from __future__ import annotations

from typing import Iterable, Mapping


class LargeRecordPacing:
    def __init__(self, rate_bytes_per_s: float, large_bytes: int, window_s: float = 1.0) -> None:
        if rate_bytes_per_s <= 0 or large_bytes < 0 or window_s <= 0:
            raise ValueError("pacing needs rate_bytes_per_s > 0, large_bytes >= 0 and window_s > 0")
        self.rate, self.large, self.window_s = float(rate_bytes_per_s), large_bytes, window_s
        self.burst = self.rate  # a second's worth
        self._tokens: dict[str, tuple[float, float]] = {}
        """Tenant -> (bytes it may take now, when that was computed)."""
        self._seen: dict[str, float] = {}
        """Tenant -> when a poll last brought records of it (swept once a window)."""
        self._swept_at = 0.0

    def polled(self, sizes: Mapping[str, Iterable[int]], now: float) -> dict[str, float]:
        """Note one poll's records (tenant -> their sizes in bytes) at ``now`` (s); return the
        tenants to hold and until when."""
        for tenant in sizes:
            self._seen[tenant] = now
        holds: dict[str, float] = {}
        for tenant, these in sizes.items():
            large = sum(n for n in these if n > self.large)
            if not large:
                continue
            tokens = self.available(tenant, now) - large
            self._tokens[tenant] = (tokens, now)
            if tokens < 0 and self._others_seen(tenant, now):
                holds[tenant] = now + -tokens / self.rate
        self._forget(now)
        return holds

    def available(self, tenant: str, now: float) -> float:
        """Bytes of large records ``tenant`` may take now (negative: what it owes)."""
        tokens, at = self._tokens.get(tenant, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def _others_seen(self, tenant: str, now: float) -> bool:
        """Whether another tenant's records came within the window (at most one more: the
        sweep runs once a window, so this stays constant time per call)."""
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
