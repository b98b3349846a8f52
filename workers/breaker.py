"""A circuit breaker for a dependency whose failure must only cost time (the cache).

Closed: calls go through. After ``failures_to_open`` consecutive failures it opens: calls
are skipped for a cool-down. Then one trial call goes through (half-open): success closes
it, failure opens it again for twice the last cool-down. The first cool-down is short
(``first_cooldown_s``) and each failed trial doubles it up to ``cooldown_s``, so a blip (a
Redis restart) costs well under a second of cache, and a long outage costs one failed trial
every ``cooldown_s``. Pure: the caller passes ``now`` (monotonic seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CircuitBreaker:
    failures_to_open: int = 3
    cooldown_s: float = 10.0
    """The longest cool-down (after repeated failed trials)."""
    first_cooldown_s: float = 0.25
    """The cool-down after the breaker first opens; doubled by every failed trial."""
    _failures: int = 0
    _open_until: float | None = None
    _cooldown: float = 0.0
    """The cool-down in force now (0 while closed)."""

    def allow(self, now: float) -> bool:
        """Whether to try the dependency now."""
        return self._open_until is None or now >= self._open_until

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self._failures, self._open_until, self._cooldown = 0, None, 0.0
            return
        self._failures += 1
        if self._open_until is not None:  # a failed trial (or a failure racing one): back off further
            self._cooldown = min(self.cooldown_s, max(self._cooldown * 2, min(self.first_cooldown_s, self.cooldown_s)))
            self._open_until = now + self._cooldown
        elif self._failures >= self.failures_to_open:
            self._cooldown = min(self.first_cooldown_s, self.cooldown_s)
            self._open_until = now + self._cooldown

    @property
    def state(self) -> str:
        return "closed" if self._open_until is None else "open"

    @property
    def current_cooldown_s(self) -> float:
        """How long the breaker stays open after its latest failure (0 while closed)."""
        return self._cooldown
