"""The Redis reuse cache of encoder outputs, used from the encode stage's prep thread.

``CacheFront`` looks every cacheable job of a polled batch up before the job is queued (hits
never reach the engine) in one round trip that also claims each miss for this worker (a Lua
script: GET, else SET NX of the miss's ``:inflight`` claim), and writes new outputs back with
one pipelined SET ... EX after their batch ran. Redis
being slow or down only costs time: a short socket timeout, then a circuit breaker that
skips the cache for a cool-down that starts at a quarter second and doubles while Redis stays
away (``workers.breaker``); every such failure is counted and logged, never shown to the
client.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from schemas.tensor import from_wire, to_wire
from workers.breaker import CircuitBreaker
from workers.outputs import Encoded, Observer
from workers.redisconn import connect

log = logging.getLogger(__name__)


LOOKUP_OR_CLAIM = """
local out = {}
for i = 1, #KEYS, 2 do
  local value = redis.call('GET', KEYS[i])
  if value then
    out[#out + 1] = value
  elseif redis.call('SET', KEYS[i + 1], '1', 'NX', 'PX', ARGV[1]) then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
"""KEYS: each key and its ``:inflight`` claim, in pairs; ARGV[1]: how long a claim holds (ms).
Per key: its value, 1 (a miss, now claimed by the caller) or 0 (a miss another worker claimed)."""


class EncoderCache:
    """MGET/SET of packed outputs, behind a circuit breaker. Thread-compatible: one caller."""

    def __init__(self, url: str, ttl_s: int, timeout_s: float = 0.05, breaker: CircuitBreaker | None = None,
                 clock: Callable[[], float] = time.monotonic, tls_ca: str | None = None) -> None:
        self.client = connect(url, tls_ca, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                              retry_on_timeout=False)
        self.ttl_s = ttl_s
        self.breaker = breaker or CircuitBreaker()
        self.clock = clock
        self._lookup_or_claim = self.client.register_script(LOOKUP_OR_CLAIM)

    def lookup_or_claim(self, keys: Sequence[str], hold_ms: int) -> list[bytes | bool] | None:
        """Per key in one round trip: its value, or for a miss whether this worker now computes
        it (True: claimed here for ``hold_ms``; False: another worker holds the claim). None
        when the cache is unavailable (skipped or failed)."""
        if not keys or not self.breaker.allow(self.clock()):
            return None
        try:
            raw = self._lookup_or_claim(keys=[k for key in keys for k in (key, f"{key}:inflight")], args=[hold_ms])
        except Exception as exc:  # any Redis trouble only costs time
            self._failed("GET/SET NX", exc)
            return None
        self.breaker.record(True, self.clock())
        return [v if isinstance(v, bytes) else bool(v) for v in raw]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None] | None:
        """Values (None per miss), or None when the cache is unavailable (skipped or failed)."""
        if not keys or not self.breaker.allow(self.clock()):
            return None
        try:
            values = self.client.mget(list(keys))
        except Exception as exc:  # any Redis trouble only costs time
            self._failed("MGET", exc)
            return None
        self.breaker.record(True, self.clock())
        return values

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> bool:
        if not items or not self.breaker.allow(self.clock()):
            return False
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=self.ttl_s)
                pipe.delete(f"{key}:inflight")
            pipe.execute()
        except Exception as exc:
            self._failed("SET", exc)
            return False
        self.breaker.record(True, self.clock())
        return True

    def _failed(self, op: str, exc: Exception) -> None:
        was = self.breaker.state
        self.breaker.record(False, self.clock())
        if self.breaker.state != was:
            log.warning("reuse cache: %s failed (%r); bypassing the cache for %.2f s, then one trial (each "
                        "failed trial doubles that, up to %.0f s)", op, exc, self.breaker.current_cooldown_s,
                        self.breaker.cooldown_s)
        else:
            log.debug("reuse cache: %s failed: %r", op, exc)


def pack_output(embedding: np.ndarray, extras: dict[str, Any], wire_dtype: str) -> bytes:
    return msgpack.packb({"e": to_wire(embedding, wire_dtype), "x": extras}, use_bin_type=True)


def unpack_output(raw: bytes) -> tuple[np.ndarray, dict[str, Any]]:
    m = msgpack.unpackb(raw, raw=False)
    return from_wire(m["e"]), dict(m.get("x") or {})


class CacheFront:
    """The reuse cache in front of an encoder, in two halves that run off the engine thread:
    ``lookup`` before a job is queued (hits never reach the engine) and ``store`` after its
    batch ran. Keys come from the caller (None for an item that is not cached).

    Single-flight across replicas: a miss that another worker is computing right now (its
    ``:inflight`` claim) is waited for, up to ``wait_ms``, and computed here only if it does
    not appear. (Identical misses of one batch run once: ``workers.encoders.EncoderFront``.)
    Every lookup is counted: ``hit``, ``miss``, or ``error`` when the cache is unavailable."""

    def __init__(self, cache: EncoderCache, metrics: Observer, modality: str,
                 wire_dtype: str = "float16", wait_ms: float = 500.0, poll_ms: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cache = cache
        self.metrics = metrics
        self.modality = modality
        self.wire_dtype = wire_dtype
        self.wait_ms = wait_ms
        self.poll_ms = poll_ms
        self.sleep = sleep

    def lookup(self, keys: list[str | None], wait_for_others: bool = True) -> list[Encoded | None]:
        """Per key: the cached output (``cache="hit"``), or None (a miss, or not cached). A
        miss another worker claimed is waited for unless ``wait_for_others`` is False (the
        caller computes it anyway)."""
        cacheable = sorted({k for k in keys if k is not None})
        values = self.cache.lookup_or_claim(cacheable, hold_ms=max(1, int(self.wait_ms * 4))) if cacheable else None
        found: dict[str, tuple[np.ndarray, dict[str, Any]]] = {}
        theirs: list[str] = []
        for key, raw in zip(cacheable, values or []):
            if raw is False:
                theirs.append(key)
            elif isinstance(raw, bytes):
                try:
                    found[key] = unpack_output(raw)
                except Exception:  # a corrupt entry is a miss
                    log.warning("reuse cache: unreadable entry %s; recomputing", key)
        if theirs and wait_for_others:
            self._wait_for_others(theirs, found)
        out: list[Encoded | None] = []
        for k in keys:
            if k is None:
                out.append(None)
            elif k in found:
                emb, extras = found[k]
                out.append(Encoded(emb, extras, cache="hit"))
                self.metrics.cache_lookup(self.modality, "hit")
            else:
                out.append(None)
                self.metrics.cache_lookup(self.modality, "miss" if values is not None else "error")
        return out

    def store(self, writes: list[tuple[str, Encoded]]) -> None:
        if writes:
            self.cache.set_many([(k, pack_output(e.embedding, e.extras, self.wire_dtype)) for k, e in writes])

    def _wait_for_others(self, theirs: list[str], found: dict[str, tuple[np.ndarray, dict[str, Any]]]) -> None:
        """Misses another worker claimed first: poll for its answer (adding it to ``found``)
        until it appears or ``wait_ms`` runs out."""
        deadline = time.monotonic() + self.wait_ms / 1000.0
        while theirs and time.monotonic() < deadline:
            self.sleep(self.poll_ms / 1000.0)
            values = self.cache.get_many(theirs)
            if values is None:
                return
            for key, raw in zip(list(theirs), values):
                if raw is not None:
                    try:
                        found[key] = unpack_output(raw)
                    except Exception:
                        continue
                    theirs.remove(key)
