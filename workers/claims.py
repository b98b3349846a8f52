"""Claim checks: payloads too big to travel inline are fetched by reference where they are
used (in the engine thread, off the event loop).

A ref resolves only inside the requesting tenant's namespace (the job's ``tenant``, which
the router set):

- ``redis:<key>`` — bytes the SDK stored with a TTL under ``mm:claim:<tenant>:`` (see
  ``schemas.request.claim_key``); they are read, never deleted, so a job that runs twice
  (after a crash) finds them again. A key outside the tenant's prefix is refused exactly as
  a missing one is, so no answer tells whether another key exists; at most ``max_bytes + 1``
  bytes are read (GETRANGE), so an oversized value is refused without holding all of it.
- ``file:///abs/path`` — only under ``<file_root>/<tenant>/`` (no file refs when the
  deployment names no root), so a request cannot read the worker's files or another
  tenant's. Every refusal reads the same, whether the file exists or not.

No error message quotes the referenced bytes or the server's paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from schemas.errors import ErrorCode, WireError
from schemas.request import TENANT_RE, claim_prefix
from workers.redisconn import connect

UNKNOWN = "the claim check is unknown or expired: send the payload again"
NO_FILE = "the referenced file is unknown or not readable by this deployment"


class ClaimResolver:
    def __init__(self, redis_url: str, file_root: Path | None, max_bytes: int, timeout_s: float = 2.0,
                 tls_ca: str | None = None) -> None:
        self.redis_url = redis_url
        self.tls_ca = tls_ca
        self.file_root = file_root.resolve() if file_root else None
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._redis: Any = None

    def fetch(self, ref: str, field: str, tenant: str) -> bytes:
        """The bytes ``ref`` names inside ``tenant``'s namespace; raises ``WireError`` naming
        ``field`` when they cannot be had (``invalid_request`` for a ref that is not the
        tenant's, unknown or expired, alike; ``payload_too_large``; ``internal`` when Redis is
        unreachable, retriable)."""
        if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
        if ref.startswith("redis:"):
            data = self._from_redis(ref[len("redis:"):], field, tenant)
        elif ref.startswith("file://"):
            data = self._from_file(ref[len("file://"):], field, tenant)
        else:
            raise WireError(ErrorCode.INVALID_REQUEST, "unknown claim-check scheme", field)
        if len(data) > self.max_bytes:
            raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                            f"the referenced payload is over the limit of {self.max_bytes} bytes", field)
        return data

    def _from_redis(self, key: str, field: str, tenant: str) -> bytes:
        prefix = claim_prefix(tenant)
        if not key.startswith(prefix) or len(key) == len(prefix):
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
        if self._redis is None:
            self._redis = connect(self.redis_url, self.tls_ca, socket_timeout=self.timeout_s,
                                  socket_connect_timeout=self.timeout_s)
        try:
            data = self._redis.getrange(key, 0, self.max_bytes)  # at most max_bytes + 1: enough to refuse
        except redis.ResponseError:  # not a string (WRONGTYPE): as good as absent
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field) from None
        except redis.RedisError as exc:
            raise WireError(ErrorCode.INTERNAL, f"could not read the claim check from Redis ({exc.__class__.__name__})",
                            field, retry_after_ms=1000) from None
        if not data:  # GETRANGE of a missing key is empty; an empty claim check is no payload either
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
        return bytes(data)

    def _from_file(self, path: str, field: str, tenant: str) -> bytes:
        if self.file_root is None:
            raise WireError(ErrorCode.INVALID_REQUEST, "file refs are not allowed by this deployment", field)
        root = self.file_root / tenant
        try:
            target = Path(path).resolve()
            if not target.is_relative_to(root.resolve()) or not target.is_file():
                raise WireError(ErrorCode.INVALID_REQUEST, NO_FILE, field)
            if target.stat().st_size > self.max_bytes:
                raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                                f"the referenced file is over the limit of {self.max_bytes} bytes", field)
            with target.open("rb") as f:
                return f.read(self.max_bytes + 1)
        except (OSError, ValueError, RuntimeError):  # unreadable, a NUL in the path, a symlink loop
            raise WireError(ErrorCode.INVALID_REQUEST, NO_FILE, field) from None
