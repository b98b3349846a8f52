"""Events on a reply topic, keyed by request id.

Wire map (version 1)::

    {v: 1, id, kind: "accepted"|"token"|"result"|"error", seq: int, ts_ms: float,
     payload: {...},          # kind-specific, see below
     error: {code, message, field, retriable, retry_after_ms} | None,
     timings: {e2e_ms, stages: [{stage, queued_ms, service_ms}], parts: [...]} | None,
     cache: {hits: int, misses: int} | None}

``result`` and ``error`` are terminal: exactly one of them ends every accepted request.
An embed result's payload is ``{task: "embed", partial: bool, parts: [{index, modality,
embedding: tensor | None, error: {...} | None, ...}]}``. Absent optional maps are left off the
wire; ``schemas.wire`` encodes and decodes the map from the fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas.wire import WireMessage, omit_none

VERSION = 1


class EventKind(StrEnum):
    ACCEPTED = "accepted"
    TOKEN = "token"
    RESULT = "result"
    ERROR = "error"


TERMINAL_KINDS = frozenset({EventKind.RESULT, EventKind.ERROR})


@dataclass(frozen=True, slots=True)
class Event(WireMessage):
    id: str
    kind: EventKind
    seq: int
    ts_ms: float
    payload: dict[str, Any] | None = omit_none()
    error: dict[str, Any] | None = omit_none()
    timings: dict[str, Any] | None = omit_none()
    cache: dict[str, Any] | None = omit_none()

    VERSION = VERSION

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS
