"""A circuit breaker for a dependency whose failure must only cost time (the cache).

Closed: calls go through. After ``failures_to_open`` consecutive failures it opens: calls
are skipped for ``cooldown_s``. Then one trial call goes through (half-open): success
closes it, failure opens it again. Pure: the caller passes ``now`` (monotonic seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CircuitBreaker:
    failures_to_open: int = 3
    cooldown_s: float = 10.0
    _failures: int = 0
    _open_until: float | None = None

    def allow(self, now: float) -> bool:
        """Whether to try the dependency now."""
        return self._open_until is None or now >= self._open_until

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self._failures, self._open_until = 0, None
            return
        self._failures += 1
        if self._failures >= self.failures_to_open or self._open_until is not None:
            self._open_until = now + self.cooldown_s

    @property
    def state(self) -> str:
        return "closed" if self._open_until is None else "open"
