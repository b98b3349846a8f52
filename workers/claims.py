"""Claim checks: payloads too big to travel inline are fetched by reference where they are
used (in the engine thread, off the event loop).

``redis:<key>`` — bytes the SDK stored with a TTL; they are read, never deleted, so a job
that runs twice (after a crash) finds them again. ``file:///abs/path`` — only under the
deployment's allow-listed directory (none by default), so a request cannot read the
worker's own files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob


class ClaimResolver:
    def __init__(self, redis_url: str, file_root: Path | None, max_bytes: int, timeout_s: float = 2.0) -> None:
        self.redis_url = redis_url
        self.file_root = file_root.resolve() if file_root else None
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._redis: Any = None

    def fetch(self, ref: str, field: str) -> bytes:
        """The referenced bytes; raises ``WireError`` naming ``field`` when they cannot be had."""
        if ref.startswith("redis:"):
            data = self._from_redis(ref[len("redis:"):], field)
        elif ref.startswith("file://"):
            data = self._from_file(ref[len("file://"):], field)
        else:
            raise WireError(ErrorCode.INVALID_REQUEST, "unknown claim-check scheme", field)
        if len(data) > self.max_bytes:
            raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                            f"the referenced payload is {len(data)} bytes; the limit is {self.max_bytes}", field)
        return data

    def _from_redis(self, key: str, field: str) -> bytes:
        import redis

        if self._redis is None:
            self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=self.timeout_s,
                                               socket_connect_timeout=self.timeout_s)
        try:
            data = self._redis.get(key)
        except redis.RedisError as exc:
            raise WireError(ErrorCode.INTERNAL, f"could not read the claim check from Redis ({exc.__class__.__name__})",
                            field, retry_after_ms=1000) from None
        if data is None:
            raise WireError(ErrorCode.INVALID_REQUEST, "the claim check is unknown or expired: send the payload again",
                            field)
        return bytes(data)

    def _from_file(self, path: str, field: str) -> bytes:
        if self.file_root is None:
            raise WireError(ErrorCode.INVALID_REQUEST, "file refs are not allowed by this deployment", field)
        target = Path(path).resolve()
        if not target.is_relative_to(self.file_root):
            raise WireError(ErrorCode.INVALID_REQUEST, f"file refs must be under {self.file_root}", field)
        try:
            size = target.stat().st_size
            if size > self.max_bytes:
                raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                                f"the referenced file is {size} bytes; the limit is {self.max_bytes}", field)
            return target.read_bytes()
        except OSError as exc:
            raise WireError(ErrorCode.INVALID_REQUEST, f"the referenced file cannot be read ({exc.strerror})",
                            field) from None


def with_claims(run_batch: Callable[[list[EncodeJob]], list[Any]], resolver: ClaimResolver
                ) -> Callable[[list[EncodeJob]], list[Any]]:
    """``run_batch`` over jobs whose refs are replaced by their bytes; a ref that cannot be
    fetched fails its own job only."""

    def run(jobs: list[EncodeJob]) -> list[Any]:
        ready: list[EncodeJob] = []
        slots: list[int | WireError] = []
        for job in jobs:
            if job.ref is None:
                slots.append(len(ready))
                ready.append(job)
                continue
            try:
                data = resolver.fetch(job.ref, f"parts.{job.part}.ref")
            except WireError as err:
                slots.append(err)
                continue
            slots.append(len(ready))
            ready.append(dataclasses.replace(job, data=data, ref=None))
        results = run_batch(ready) if ready else []
        return [results[s] if isinstance(s, int) else s for s in slots]

    return run
