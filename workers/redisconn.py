"""Every Redis connection of the project is made here, so credentials, TLS and timeouts apply
alike.

A URL says how to connect: ``redis://user:password@host:port/db`` authenticates as an ACL
user (``AUTH user password``), ``rediss://`` speaks TLS and checks the server's certificate
(against ``tls_ca``, a CA file, when given; else the system's CAs). Two users matter
(infra/redis/redis.conf): the workers' (``settings.redis.url``: the reuse cache, load
reports, claim checks) and the clients' (``settings.redis.client_url``: may only SET and GET
claim checks). Nothing here prints or logs a URL: it may hold a password.

Failing fast: every caller treats Redis as something whose failure costs only time (the
cache and load reports are skipped, a claim check is answered with a retriable error), so a
call must not wait long for a Redis that is away. A client made from a URL does not retry a
failed command (redis-py's default there) and reconnects a pooled connection that a Redis
restart closed on its own (measured: the first call after a kill -9 and restart succeeds);
a refused connection fails in the call. What redis-py leaves unbounded is the connect
itself: without ``socket_connect_timeout`` a connect to a host that drops packets waits for
the kernel (minutes). Clients made here never wait more than ``CONNECT_TIMEOUT_S`` (a caller
may pass a shorter one). What happens across calls while Redis stays away is the callers'
circuit breaker (``workers.breaker``).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio

CONNECT_TIMEOUT_S = 1.0
"""Connect timeout when the caller gives none."""


def _tls(url: str, tls_ca: str | None) -> dict[str, Any]:
    if url.startswith("rediss://") and tls_ca:
        return {"ssl_ca_certs": tls_ca}
    return {}


def _defaults(options: dict[str, Any]) -> dict[str, Any]:
    out = dict(options)
    if out.get("socket_connect_timeout") is None:
        out["socket_connect_timeout"] = CONNECT_TIMEOUT_S
    return out


def connect(url: str, tls_ca: str | None = None, **options: Any) -> redis.Redis:
    """A blocking client for ``url``; ``options`` go to redis-py (timeouts, retries)."""
    return redis.Redis.from_url(url, **_tls(url, tls_ca), **_defaults(options))


def connect_async(url: str, tls_ca: str | None = None, **options: Any) -> redis.asyncio.Redis:
    """An asyncio client for ``url``; ``options`` go to redis-py."""
    return redis.asyncio.Redis.from_url(url, **_tls(url, tls_ca), **_defaults(options))
