"""When the SDK sends a request again: a pure policy over an error event.

Only what the pipeline marks ``retriable`` is retried (``overloaded``, ``deadline_exceeded``,
``internal``); the wait is exponential backoff with jitter, never shorter than the
``retry_after_ms`` the pipeline asked for, and the attempts and the total time are bounded,
so a client never hammers an overloaded pipeline nor waits forever.

    delay = max(backoff * U(1 - jitter, 1), retry_after_ms * U(1, 1 + jitter))
    backoff = min(max_delay_ms, base_delay_ms * 2 ** (attempt - 1))

The jitter on ``retry_after_ms`` goes upwards only: a crowd of clients told "come back in
one second" spreads out after that second instead of arriving together at it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """How the SDK retries; ``RetryConfig(max_attempts=1)`` (or ``NO_RETRY``) switches it off."""

    max_attempts: int = 4
    """Sends of one request in all, the first included."""
    base_delay_ms: float = 100.0
    """Backoff before the second attempt; doubled for each later one."""
    max_delay_ms: float = 5_000.0
    """Cap of one backoff (not of ``retry_after_ms``, which the pipeline knows better)."""
    max_total_ms: float = 30_000.0
    """No retry is started when it would begin later than this after the first send."""
    jitter: float = 0.2
    """Fraction of each delay drawn at random, so clients do not retry in lockstep."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_ms < 0 or self.max_delay_ms < 0 or self.max_total_ms < 0:
            raise ValueError("delays must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be within [0, 1], got {self.jitter}")

    @property
    def enabled(self) -> bool:
        return self.max_attempts > 1


NO_RETRY = RetryConfig(max_attempts=1)


def retry_delay_ms(config: RetryConfig, attempt: int, error: Mapping[str, Any] | None, elapsed_ms: float,
                   rng: random.Random) -> float | None:
    """Milliseconds to wait before attempt ``attempt + 1``, or None to give up.

    ``attempt``: the attempt that just failed (1 for the first send); ``error``: the error
    map of its terminal event (``retriable``, ``retry_after_ms``); ``elapsed_ms``: time since
    the first send. Gives up when the error is not retriable, the attempts are spent, or
    the retry would start after ``max_total_ms``.
    """
    if not error or not error.get("retriable") or attempt >= config.max_attempts:
        return None
    backoff = min(config.max_delay_ms, config.base_delay_ms * 2 ** (attempt - 1))
    delay = backoff * rng.uniform(1.0 - config.jitter, 1.0)
    retry_after = error.get("retry_after_ms")
    if isinstance(retry_after, (int, float)) and retry_after > 0:
        delay = max(delay, float(retry_after) * rng.uniform(1.0, 1.0 + config.jitter))
    if elapsed_ms + delay > config.max_total_ms:
        return None
    return delay
