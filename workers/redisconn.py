"""Every Redis connection of the project is made here, so credentials and TLS apply alike.

A URL says how to connect: ``redis://user:password@host:port/db`` authenticates as an ACL
user (``AUTH user password``), ``rediss://`` speaks TLS and checks the server's certificate
(against ``tls_ca``, a CA file, when given; else the system's CAs). Two users matter
(infra/redis/redis.conf): the workers' (``settings.redis.url``: the reuse cache, load
reports, claim checks) and the clients' (``settings.redis.client_url``: may only SET and GET
claim checks). Nothing here prints or logs a URL: it may hold a password.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio


def _tls(url: str, tls_ca: str | None) -> dict[str, Any]:
    if url.startswith("rediss://") and tls_ca:
        return {"ssl_ca_certs": tls_ca}
    return {}


def connect(url: str, tls_ca: str | None = None, **options: Any) -> redis.Redis:
    """A blocking client for ``url``; ``options`` go to redis-py (timeouts, retries)."""
    return redis.Redis.from_url(url, **_tls(url, tls_ca), **options)


def connect_async(url: str, tls_ca: str | None = None, **options: Any) -> redis.asyncio.Redis:
    """An asyncio client for ``url``; ``options`` go to redis-py."""
    return redis.asyncio.Redis.from_url(url, **_tls(url, tls_ca), **options)
