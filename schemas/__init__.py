"""Wire formats of mmstream: MessagePack maps with a version field ``v``.

This package imports nothing else of the project, so a client needs only it (and msgpack,
numpy) to speak to a deployment. JSON encodings of the same maps are accepted on ingress.
"""

from schemas.codec import DecodeError, pack, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.request import Lane, Limits, Modality, Params, Part, Request, Task

SCHEMA_VERSION = 1

__all__ = [
    "SCHEMA_VERSION", "DecodeError", "ErrorCode", "Event", "EventKind", "Lane", "Limits",
    "Modality", "Params", "Part", "Request", "Task", "WireError", "pack", "unpack",
]
