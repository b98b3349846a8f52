"""Sending a stage's outputs and waiting for the broker to take them; dead-letter records.

A stage acknowledges its input only after its outputs are delivered, so a crash between
the two repeats work (downstream stages are idempotent) but never loses it.

A record that cannot be handled goes to the DLQ as it came (value and original headers),
plus why (``x-mm-error``, stable code or reason first) and where from (``x-mm-source``).
``dead_letter`` builds every such record, so that they all read the same and all fit: a
record as big as the broker allows, plus our headers, would be refused by the producer and
leave the stage unable to park it, so the whole record is cut to ``max_bytes`` and the cut
is named in ``x-mm-truncated``. A deployment that must not keep what clients sent
(``dlq.keep_payload`` off) parks the metadata only: the value is dropped, and
``x-mm-truncated`` says how big it was.

Headers named like the pipeline's own (``x-mm-*``, any case) are the pipeline's alone: an
original header so named is dropped (and counted in ``x-mm-truncated``), so what a reader of
the DLQ takes for ``x-mm-error`` or ``x-mm-source`` is always what the pipeline wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from schemas.codec import CONTENT_TYPE_HEADER, ERROR_HEADER, MSGPACK, SOURCE_HEADER, TRUNCATED_HEADER, pack

MAX_REASON_BYTES = 1000
"""The longest ``x-mm-error`` value: a reason quotes an exception, which may quote input."""
MAX_SOURCE_BYTES = 300
PIPELINE_HEADER_PREFIX = "x-mm-"
"""The header names the pipeline writes (``schemas.codec``): never copied from a client."""
RECORD_OVERHEAD_BYTES = 128
"""Room kept for what the producer adds around key, value and headers when it sizes a record
(aiokafka: a 61-byte batch header, up to 21 bytes of record framing) and for varints."""
_FIELD_OVERHEAD = 5  # the varint length prefix of a key, value, header name or header value


@dataclass(frozen=True, slots=True)
class Out:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    partition: int | None = None
    """None: the producer's partitioner picks from the key."""


def out_map(topic: str, key: str | bytes, obj: dict[str, Any], partition: int | None = None) -> Out:
    """An output whose value is a MessagePack map."""
    k = key.encode() if isinstance(key, str) else key
    return Out(topic, k, pack(obj), [(CONTENT_TYPE_HEADER, MSGPACK.encode())], partition)


def dead_letter(dlq_topic: str, key: str | bytes | None, value: bytes | None, reason: str,
                headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = (), source: str | None = None,
                *, max_bytes: int, keep_payload: bool = True) -> Out:
    """The DLQ record for an input that could not be handled.

    ``value`` and the original ``headers`` (pairs or a map; str values are UTF-8 encoded,
    None becomes empty) are kept as they came, followed by ``x-mm-error: reason`` (cut to
    ``MAX_REASON_BYTES``) and, when given, ``x-mm-source: source`` (``topic[partition]@offset``).
    The whole record stays within ``max_bytes`` (the producer's ``max_request_size``, from
    ``settings.kafka.max_message_bytes``): when it would not, original headers are dropped
    from the last while they alone do not fit, the value is cut to the room left, and
    ``x-mm-truncated`` says what was cut (``value 9000000 -> 8386000 bytes; 1 original header
    dropped``). The key is kept: it fitted the broker's limit when it arrived. Without
    ``keep_payload`` the value is empty and ``x-mm-truncated`` says ``value N bytes dropped``.
    """
    k = key.encode() if isinstance(key, str) else key
    raw = bytes(value or b"")
    ours = [(ERROR_HEADER, _cut(reason, MAX_REASON_BYTES))]
    if source is not None:
        ours.append((SOURCE_HEADER, _cut(source, MAX_SOURCE_BYTES)))
    notes: list[str] = []
    if not keep_payload:
        notes.append(f"value {len(raw)} bytes dropped (dlq.keep_payload off)")
        raw = b""
    given = [(str(name), v) for name, v in _pairs(headers)]
    original = [(name, _header_bytes(v)) for name, v in given if not is_pipeline_header(name)]
    if len(given) > len(original):
        spoofed = len(given) - len(original)
        notes.append(f"{spoofed} original x-mm-* header{'s' if spoofed > 1 else ''} dropped")
    noted = [(TRUNCATED_HEADER, "; ".join(notes).encode())] if notes else []
    room = (max_bytes - RECORD_OVERHEAD_BYTES - _size(k) - _size(raw)
            - sum(_header_size(h) for h in ours + noted + original))
    if room >= 0:
        return Out(dlq_topic, k, raw, original + ours + noted)
    # Cut: reserve room for the note itself (its longest form), then keep what fits.
    budget = (max_bytes - RECORD_OVERHEAD_BYTES - _size(k) - sum(_header_size(h) for h in ours)
              - _header_size((TRUNCATED_HEADER, b"x" * 120)) - _FIELD_OVERHEAD)
    kept = list(original)
    while kept and sum(_header_size(h) for h in kept) > budget:
        kept.pop()
    cut_to = max(0, min(len(raw), budget - sum(_header_size(h) for h in kept)))
    note = f"value {len(raw)} -> {cut_to} bytes"
    if len(kept) < len(original):
        dropped = len(original) - len(kept)
        note += f"; {dropped} original header{'s' if dropped > 1 else ''} dropped"
    note = "; ".join([note, *notes])
    return Out(dlq_topic, k, raw[:cut_to], kept + ours + [(TRUNCATED_HEADER, note.encode())])


def is_pipeline_header(name: str) -> bool:
    """Whether a header name is one the pipeline writes itself (``x-mm-*``, any case)."""
    return name.strip().lower().startswith(PIPELINE_HEADER_PREFIX)


def _pairs(headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> Iterable[tuple[str, Any]]:
    if not headers:
        return ()
    return headers.items() if isinstance(headers, Mapping) else headers


def _header_bytes(value: Any) -> bytes:
    if value is None:
        return b""
    return value.encode() if isinstance(value, str) else bytes(value)


def _cut(text: str, limit: int) -> bytes:
    """UTF-8 of ``text``, cut to ``limit`` bytes at a character boundary."""
    return text.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore").encode()


def _size(field_bytes: bytes | None) -> int:
    return _FIELD_OVERHEAD + (len(field_bytes) if field_bytes is not None else 0)


def _header_size(h: tuple[str, bytes]) -> int:
    return _size(h[0].encode()) + _size(h[1])
