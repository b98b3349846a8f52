"""Events on a reply topic, keyed by request id.

Wire map (version 1)::

    {v: 1, id, kind: "accepted"|"token"|"result"|"error", seq: int, ts_ms: float,
     payload: {...},          # kind-specific, see below
     error: {code, message, field, retriable, retry_after_ms} | None,
     timings: {e2e_ms, stages: [{stage, queued_ms, service_ms}], parts: [...]} | None,
     cache: {hits: int, misses: int} | None}

``result`` and ``error`` are terminal: exactly one of them ends every accepted request.
An embed result's payload is ``{task: "embed", partial: bool, parts: [{index, modality,
embedding: tensor | None, error: {...} | None, ...}]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas.errors import WireError

VERSION = 1


class EventKind(StrEnum):
    ACCEPTED = "accepted"
    TOKEN = "token"
    RESULT = "result"
    ERROR = "error"


TERMINAL_KINDS = frozenset({EventKind.RESULT, EventKind.ERROR})


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    kind: EventKind
    seq: int
    ts_ms: float
    payload: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS

    def to_wire(self) -> dict[str, Any]:
        m: dict[str, Any] = {"v": VERSION, "id": self.id, "kind": str(self.kind), "seq": self.seq, "ts_ms": self.ts_ms}
        for name in ("payload", "error", "timings", "cache"):
            value = getattr(self, name)
            if value is not None:
                m[name] = value
        return m

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> "Event":
        """Raises ``ValueError`` when the map is not a version-1 event."""
        if m.get("v") != VERSION:
            raise ValueError(f"unsupported event version {m.get('v')!r}")
        try:
            return cls(id=str(m["id"]), kind=EventKind(m["kind"]), seq=int(m["seq"]), ts_ms=float(m["ts_ms"]),
                       payload=m.get("payload"), error=m.get("error"), timings=m.get("timings"), cache=m.get("cache"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed event: {exc}") from None

    def as_error(self) -> WireError | None:
        return WireError.from_wire(self.error) if self.error else None
