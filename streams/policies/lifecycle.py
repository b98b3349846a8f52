"""A request's life as explicit state: statuses, the allowed transitions, and the table that
maps each terminal status to what the client sees."""

from __future__ import annotations

from enum import StrEnum



class RequestStatus(StrEnum):
    RECEIVED = "received"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    ENCODING = "encoding"
    FINISHED = "finished"
    FINISHED_PARTIAL = "finished_partial"
    FAILED = "failed"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    FORWARDED = "forwarded"
    """Assembled and handed to the generator, which owns its terminal event from here."""


TERMINAL = frozenset({
    RequestStatus.REJECTED, RequestStatus.FINISHED, RequestStatus.FINISHED_PARTIAL,
    RequestStatus.FAILED, RequestStatus.DEADLINE_EXCEEDED, RequestStatus.FORWARDED,
})

TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.RECEIVED: frozenset({RequestStatus.ACCEPTED, RequestStatus.REJECTED}),
    RequestStatus.ACCEPTED: frozenset({RequestStatus.ENCODING, RequestStatus.FAILED, RequestStatus.DEADLINE_EXCEEDED}),
    RequestStatus.ENCODING: frozenset({
        RequestStatus.FINISHED, RequestStatus.FINISHED_PARTIAL, RequestStatus.FAILED, RequestStatus.DEADLINE_EXCEEDED,
        RequestStatus.FORWARDED,
    }),
    **{s: frozenset() for s in TERMINAL},
}


class TransitionError(RuntimeError):
    """A status change the lifecycle does not allow (a bug, never a client error)."""


def advance(current: RequestStatus, new: RequestStatus) -> RequestStatus:
    """Return ``new`` if the lifecycle allows ``current -> new``; raise ``TransitionError``."""
    if new not in TRANSITIONS[current]:
        raise TransitionError(f"{current} -> {new} is not allowed")
    return new
