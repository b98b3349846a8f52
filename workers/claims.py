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

Refs are priced before they are read: the router sizes each one (``ClaimSizer``: STRLEN of
the key, the file's size) at admission, and the job carries that size (``ref_bytes``), so
the worker reads at most what was priced (a value that grew since is refused, never read
whole). Sizing also caps a referenced claim check's remaining life at ``claim_ttl_s``
(``EXPIRE ... LT``): one stored without an expiry gets one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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

    def fetch(self, ref: str, field: str, tenant: str, priced_bytes: int | None = None) -> bytes:
        """The bytes ``ref`` names inside ``tenant``'s namespace; raises ``WireError`` naming
        ``field`` when they cannot be had (``invalid_request`` for a ref that is not the
        tenant's, unknown or expired, alike; ``payload_too_large``; ``internal`` when Redis is
        unreachable, retriable). ``priced_bytes``: the size the router priced the ref at
        (the job's ``ref_bytes``); at most that many bytes are read, and more is refused."""
        if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
        limit = self.max_bytes if priced_bytes is None else max(0, min(self.max_bytes, priced_bytes))
        if ref.startswith("redis:"):
            data = self._from_redis(ref[len("redis:"):], field, tenant, limit)
        elif ref.startswith("file://"):
            data = self._from_file(ref[len("file://"):], field, tenant, limit)
        else:
            raise WireError(ErrorCode.INVALID_REQUEST, "unknown claim-check scheme", field)
        if len(data) > limit:
            raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, _over(limit, self.max_bytes), field)
        return data

    def _from_redis(self, key: str, field: str, tenant: str, limit: int) -> bytes:
        if not in_claim_namespace(key, tenant):
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
        if self._redis is None:
            self._redis = connect(self.redis_url, self.tls_ca, socket_timeout=self.timeout_s,
                                  socket_connect_timeout=self.timeout_s)
        try:
            data = self._redis.getrange(key, 0, limit)  # at most limit + 1: enough to refuse
        except redis.ResponseError:  # not a string (WRONGTYPE): as good as absent
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field) from None
        except redis.RedisError as exc:
            raise WireError(ErrorCode.INTERNAL, f"could not read the claim check from Redis ({exc.__class__.__name__})",
                            field, retry_after_ms=1000) from None
        if not data:  # GETRANGE of a missing key is empty; an empty claim check is no payload either
            raise WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
        return bytes(data)

    def _from_file(self, path: str, field: str, tenant: str, limit: int) -> bytes:
        target = file_target(self.file_root, path, field, tenant)
        try:
            if target.stat().st_size > limit:
                raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, _over(limit, self.max_bytes), field)
            with target.open("rb") as f:
                return f.read(limit + 1)
        except (OSError, ValueError, RuntimeError):
            raise WireError(ErrorCode.INVALID_REQUEST, NO_FILE, field) from None


def _over(limit: int, max_bytes: int) -> str:
    if limit < max_bytes:
        return f"the referenced payload is larger than the {limit} bytes it was admitted at: send the request again"
    return f"the referenced payload is over the limit of {max_bytes} bytes"


def in_claim_namespace(key: str, tenant: str) -> bool:
    """Whether Redis ``key`` is one of ``tenant``'s claim checks (under its prefix, not the prefix)."""
    prefix = claim_prefix(tenant)
    return key.startswith(prefix) and len(key) > len(prefix)


def file_target(file_root: Path | None, path: str, field: str, tenant: str) -> Path:
    """The file a ``file://`` ref names, when it is a file under ``<file_root>/<tenant>/``;
    raises ``WireError`` (``invalid_request``, the same words whether or not it exists)."""
    if file_root is None:
        raise WireError(ErrorCode.INVALID_REQUEST, "file refs are not allowed by this deployment", field)
    root = file_root / tenant
    try:
        target = Path(path).resolve()
        if not target.is_relative_to(root.resolve()) or not target.is_file():
            raise WireError(ErrorCode.INVALID_REQUEST, NO_FILE, field)
        return target
    except (OSError, ValueError, RuntimeError):  # unreadable, a NUL in the path, a symlink loop
        raise WireError(ErrorCode.INVALID_REQUEST, NO_FILE, field) from None


@dataclass(frozen=True, slots=True)
class ClaimSize:
    """What the router learns of one ref before anything reads it."""

    size: int
    """Its stored bytes."""
    head: bytes = b""
    """Its first bytes (at most ``ClaimSizer.head_bytes``): an image's header prices its decode."""


class ClaimSizer:
    """Prices refs at admission: the stored size of each (STRLEN of a tenant's claim check, the
    size of a file under its directory) and its first ``head_bytes`` bytes, in one Redis
    round trip for a request's redis refs. Each referenced claim check's remaining life is
    capped at ``ttl_s`` on the way (one stored without an expiry gets one). ``redis``: an
    asyncio client as the workers' user."""

    def __init__(self, redis: Any, file_root: Path | None, ttl_s: int, head_bytes: int = 0) -> None:
        self.redis = redis
        self.file_root = file_root.resolve() if file_root else None
        self.ttl_s = ttl_s
        self.head_bytes = head_bytes

    async def sizes(self, refs: Sequence[tuple[int, str]], tenant: str,
                    heads: frozenset[int] = frozenset()) -> dict[int, ClaimSize | WireError]:
        """Part index -> its size and head (for the parts in ``heads``), or the ``WireError`` the part fails with (named
        ``parts.<i>.ref``: unknown, not the tenant's, not readable, alike; ``internal``,
        retriable, when Redis does not answer)."""
        out: dict[int, ClaimSize | WireError] = {}
        keys: list[tuple[int, str]] = []
        for i, ref in refs:
            field = f"parts.{i}.ref"
            if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
                out[i] = WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
            elif ref.startswith("redis:"):
                key = ref[len("redis:"):]
                if in_claim_namespace(key, tenant):
                    keys.append((i, key))
                else:
                    out[i] = WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, field)
            elif ref.startswith("file://"):
                try:
                    out[i] = self._file_size(file_target(self.file_root, ref[len("file://"):], field, tenant),
                                             i in heads)
                except WireError as err:
                    out[i] = err
                except OSError:
                    out[i] = WireError(ErrorCode.INVALID_REQUEST, NO_FILE, field)
            else:
                out[i] = WireError(ErrorCode.INVALID_REQUEST, "unknown claim-check scheme", field)
        if keys:
            out.update(await self._redis_sizes(keys, heads))
        return out

    def _file_size(self, path: Path, head: bool) -> ClaimSize:
        if self.head_bytes <= 0 or not head:
            return ClaimSize(path.stat().st_size)
        with path.open("rb") as f:
            return ClaimSize(os.fstat(f.fileno()).st_size, f.read(self.head_bytes))

    async def _redis_sizes(self, keys: list[tuple[int, str]], heads: frozenset[int]) -> dict[int, ClaimSize | WireError]:
        distinct = list(dict.fromkeys(key for _, key in keys))  # one key named by many parts is read once
        headed = {key for i, key in keys if i in heads} if self.head_bytes > 0 else set()
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key in distinct:
                pipe.strlen(key)
                pipe.expire(key, self.ttl_s, lt=True)
                if key in headed:
                    pipe.getrange(key, 0, self.head_bytes - 1)
            replies = iter(await pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            return {i: WireError(ErrorCode.INTERNAL, f"could not size the claim check in Redis "
                                 f"({exc.__class__.__name__})", f"parts.{i}.ref", retry_after_ms=1000)
                    for i, _ in keys}
        found: dict[str, ClaimSize | None] = {}
        for key in distinct:
            size, _ = next(replies), next(replies)
            head = next(replies) if key in headed else b""
            if isinstance(size, Exception) or not isinstance(size, int) or size <= 0:  # absent, empty, not a string
                found[key] = None
            else:
                found[key] = ClaimSize(size, head if isinstance(head, bytes) else b"")
        return {i: found[key] or WireError(ErrorCode.INVALID_REQUEST, UNKNOWN, f"parts.{i}.ref") for i, key in keys}
