"""Bytes <-> maps. Stages read raw bytes and call these explicitly, so a poison message is
handled by our code (sent to the DLQ with its reason), never by a framework deserializer."""

from __future__ import annotations

import json
from typing import Any

import msgpack

CONTENT_TYPE_HEADER = "content-type"
MSGPACK = "application/msgpack"
JSON = "application/json"
ERROR_HEADER = "x-mm-error"
"""Header of a dead-lettered record: why it could not be handled (stable code first)."""
SOURCE_HEADER = "x-mm-source"
"""Header of a dead-lettered record: topic[partition]@offset it came from."""
TRUNCATED_HEADER = "x-mm-truncated"
"""Header of a dead-lettered record cut to fit the producer's record size: what was cut."""


MAX_DEPTH = 32
"""Deepest nesting of maps and lists a message may have. Ours stay under ten levels; a deeper
one is refused here, so no later walk of it (packing an event, a recursive comparison) can
run out of stack."""


class DecodeError(ValueError):
    """Bytes that are neither a MessagePack map nor a JSON object (or nested too deeply)."""


def pack(obj: dict[str, Any]) -> bytes:
    """Encode a map as MessagePack (bin type for bytes, so binary payloads stay binary)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(raw: bytes, content_type: str | None = None) -> dict[str, Any]:
    """Decode one message to a map.

    The content type (a header) wins when given; otherwise JSON is sniffed from a leading
    ``{``, and anything else is read as MessagePack. Raises ``DecodeError`` with a reason
    when the bytes do not decode to a map, nesting past ``MAX_DEPTH`` included, and never
    anything else (no RecursionError, no TypeError from a map keyed by a list).
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(raw).__name__}")
    raw = bytes(raw)
    if not raw:
        raise DecodeError("empty message")
    is_json = (content_type or "").lower().startswith(JSON) or (
        content_type is None and raw.lstrip()[:1] == b"{"
    )
    try:
        if is_json:
            obj = json.loads(raw.decode("utf-8"))
        else:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        kind = "JSON" if is_json else "MessagePack"
        raise DecodeError(f"not valid {kind}: {str(exc)[:200]}") from None
    except RecursionError:  # the JSON parser recurses per level; MessagePack stops at StackError
        raise DecodeError("nested too deeply") from None
    except TypeError as exc:  # a MessagePack map keyed by a list or a map (unhashable)
        raise DecodeError(f"not valid MessagePack: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a map at the top level, got {type(obj).__name__}")
    if _too_deep(obj, MAX_DEPTH):
        raise DecodeError(f"nested more than {MAX_DEPTH} levels deep")
    return obj


def _too_deep(obj: Any, limit: int) -> bool:
    """Whether maps and lists nest more than ``limit`` levels in ``obj`` (iterative: no stack)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return False


def header(headers: Any, name: str) -> str | None:
    """Read one header (any case) from Kafka headers given as a list of pairs or a map."""
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for key, value in items:
        if key.lower() == name:
            return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    return None
