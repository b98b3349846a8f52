"""The whole-result cache: identical requests (same tenant, task, content and models) get
the stored answer straight from the router, without touching an encoder.

Best effort like the encoder cache: a short timeout and a circuit breaker, so Redis slow or
down only costs time. Only complete embed answers are stored (never partial ones, never
generations).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack

from workers.breaker import CircuitBreaker
from workers.redisconn import connect_async

log = logging.getLogger(__name__)


class ResultCache:
    def __init__(self, redis_url: str, ttl_s: int, timeout_s: float = 0.05,
                 breaker: CircuitBreaker | None = None, tls_ca: str | None = None) -> None:
        self.redis = connect_async(redis_url, tls_ca, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self.breaker = breaker or CircuitBreaker()

    async def get(self, key: str) -> dict[str, Any] | None:
        """The stored answer's payload, or None (a miss, or the cache unavailable)."""
        if not self.breaker.allow(time.monotonic()):
            return None
        try:
            raw = await self.redis.get(key)
        except Exception as exc:
            self._failed(exc)
            return None
        self.breaker.record(True, time.monotonic())
        if raw is None:
            return None
        try:
            return msgpack.unpackb(raw, raw=False)
        except Exception:
            return None

    async def put(self, key: str, payload: dict[str, Any]) -> None:
        if not self.breaker.allow(time.monotonic()):
            return
        try:
            await self.redis.set(key, msgpack.packb(payload, use_bin_type=True), ex=self.ttl_s)
            self.breaker.record(True, time.monotonic())
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.breaker.record(False, time.monotonic())
        log.warning("result cache unavailable (%r); requests are computed", exc)
