"""Stable error codes and the error raised by validation.

The code strings are part of the wire contract: never rename one. Each code says whether a
retry can help and, when it can, roughly after how long.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA = "unsupported_media"
    OVERLOADED = "overloaded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    retriable: bool
    """Whether sending the same request again can succeed."""
    retry_after_ms: int | None
    """A default wait before retrying; an event may carry a better one."""


RETRY: dict[ErrorCode, RetryPolicy] = {
    ErrorCode.INVALID_REQUEST: RetryPolicy(False, None),
    ErrorCode.PAYLOAD_TOO_LARGE: RetryPolicy(False, None),
    ErrorCode.UNSUPPORTED_MEDIA: RetryPolicy(False, None),
    ErrorCode.OVERLOADED: RetryPolicy(True, 1000),
    ErrorCode.DEADLINE_EXCEEDED: RetryPolicy(True, 0),
    ErrorCode.INTERNAL: RetryPolicy(True, 1000),
}


class WireError(Exception):
    """A request (or one part of it) that cannot be served, with a stable code.

    ``field`` names the offending field in dotted form (``parts.2.mime``) so the message
    tells a person exactly what to fix.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        field: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field
        policy = RETRY[code]
        self.retriable = policy.retriable
        self.retry_after_ms = retry_after_ms if retry_after_ms is not None else policy.retry_after_ms

    def __reduce__(self) -> tuple:
        # Pickled as its fields (Exception's default is its one message string, which this
        # constructor does not take): a decode in another process raises it back here.
        return (type(self), (self.code, self.message, self.field, self.retry_after_ms))

    def to_wire(self) -> dict:
        """The ``error`` map of an event."""
        return {
            "code": str(self.code),
            "message": self.message,
            "field": self.field,
            "retriable": self.retriable,
            "retry_after_ms": self.retry_after_ms,
        }

    @classmethod
    def from_wire(cls, m: dict) -> "WireError":
        return cls(ErrorCode(m["code"]), m.get("message", ""), m.get("field"), m.get("retry_after_ms"))
