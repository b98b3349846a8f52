"""A token bucket per key (events per second, a burst), bounded in keys: what bounds one
tenant's share of something every tenant writes to, such as the dead-letter topic. Pure."""

from __future__ import annotations

from collections import OrderedDict


class KeyedBudget:
    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 10_000) -> None:
        self.rate_per_s = rate_per_s
        self.burst = max(burst, 1.0)
        self.max_keys = max_keys
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """key -> (tokens, at ms), least recently used first."""

    def take(self, key: str, now_ms: float) -> bool:
        """Spend one token of ``key``'s bucket; False (nothing spent) when it is empty. A rate
        of 0 means no limit."""
        if self.rate_per_s <= 0:
            return True
        tokens, at = self._tokens.pop(key, (self.burst, now_ms))
        tokens = min(self.burst, tokens + max(0.0, now_ms - at) * self.rate_per_s / 1000.0)
        ok = tokens >= 1.0
        self._tokens[key] = (tokens - 1.0 if ok else tokens, now_ms)
        while len(self._tokens) > self.max_keys:  # the idle ones go first; a new key starts full
            self._tokens.popitem(last=False)
        return ok
