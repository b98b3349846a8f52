"""Collections on the wire: documents a tenant writes, and the vectors the indexing stage makes.

A collection is the compacted topic ``<prefix>.docs.<tenant>.<collection>``, keyed by the
document id (UTF-8). A record's value is a document map (msgpack, or JSON for shell tools)::

    {v: 1, text: str, meta: {key: str | int | float | bool}}                  a passage
    {v: 1, image: bytes | ref: str, mime: str, text?: str, meta: {...}}      an image

and a record without a value (a tombstone) deletes the document. Compaction keeps the last
record per id, so the topic is the collection. An image document is embedded by the image
encoder and searched by image queries (its ``text``, a caption, is what a hit shows); a
passage by the text encoder and searched by text queries. ``ref`` is a claim check in the
tenant's namespace (``redis:<key>``, as a request part's), read when the document is indexed.

The indexing stage embeds each document and writes a vector record to the internal,
compacted ``<prefix>.vectors`` topic, keyed by ``vector_key(tenant, collection, model,
doc_id)`` (a msgpack array, so no separator can be forged inside a name); a tombstone there
deletes too. The retrieve stage's indexes are state derived from that topic.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from schemas.errors import ErrorCode, WireError
from schemas.wire import WireMessage

VERSION = 1
MAX_DOC_ID_BYTES = 256


def doc_id_of(key: bytes | None) -> str:
    """The document id a record key names; ``WireError`` when it is missing, too long or not
    UTF-8 text of printable characters."""
    if not key:
        raise WireError(ErrorCode.INVALID_REQUEST, "a document record needs its id as the record key", "key")
    if len(key) > MAX_DOC_ID_BYTES:
        raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"document id is {len(key)} bytes; the limit is "
                        f"{MAX_DOC_ID_BYTES}", "key")
    try:
        doc_id = key.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(ErrorCode.INVALID_REQUEST, "document id is not UTF-8", "key") from None
    if not doc_id.isprintable():
        raise WireError(ErrorCode.INVALID_REQUEST, "document id holds control characters", "key")
    return doc_id


IMAGE_MIMES = frozenset({"image/jpeg", "image/png", "image/webp"})
READY_PREFIX = "\x00ready:"
"""The doc id of a ready marker: no document id can start with it (ids are printable)."""


@dataclass(frozen=True, slots=True)
class Document:
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    image: bytes | None = None
    ref: str | None = None
    mime: str | None = None

    @property
    def modality(self) -> str:
        return "image" if self.image is not None or self.ref is not None else "text"

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION, "text": self.text, "meta": dict(self.meta)}
        for k in ("image", "ref", "mime"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


def ready_key(tenant: str, collection: str, model: str, partition: int) -> bytes:
    """The vectors-topic key of the indexing stage's marker that ``model``'s space has caught
    up with one partition of the collection's topic (value: ``{"ready": [partition, partitions]}``)."""
    return vector_key(tenant, collection, model, f"{READY_PREFIX}{partition}")


def decode_document(value: bytes, max_chars: int, max_meta_keys: int,
                    max_image_bytes: int = 4 * 1024 * 1024) -> Document:
    """A document from a record value (msgpack, or JSON when it starts with ``{``); every
    bound checked, the field named in the ``WireError``. ``max_image_bytes`` bounds inline
    image bytes here; a ref's stored bytes are bounded where they are read."""
    try:
        obj = json.loads(value) if value[:1] == b"{" else msgpack.unpackb(value, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, RecursionError) as exc:
        raise WireError(ErrorCode.INVALID_REQUEST, f"document is neither msgpack nor JSON: {type(exc).__name__}",
                        "value") from None
    if not isinstance(obj, dict):
        raise WireError(ErrorCode.INVALID_REQUEST, "a document is a map", "value")
    if obj.get("v", VERSION) != VERSION:
        raise WireError(ErrorCode.INVALID_REQUEST, f"document version {obj.get('v')!r} is not supported "
                        f"(v{VERSION})", "v")
    image, ref, mime = _image_of(obj)
    if image is not None and len(image) > max_image_bytes:
        raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"the image is {len(image)} bytes; the limit is {max_image_bytes}",
                        "image")
    text = obj.get("text", "" if image is not None or ref is not None else None)
    if not isinstance(text, str) or (image is None and ref is None and not text.strip()):
        raise WireError(ErrorCode.INVALID_REQUEST, "a document needs a non-empty text, or an image", "text")
    if len(text) > max_chars:
        raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"document text is {len(text)} characters; the limit is "
                        f"{max_chars}", "text")
    meta = obj.get("meta") or {}
    if not isinstance(meta, dict) or len(meta) > max_meta_keys:
        raise WireError(ErrorCode.INVALID_REQUEST, f"meta must be a map of at most {max_meta_keys} keys", "meta")
    for k, v in meta.items():
        if not (isinstance(k, str) and 0 < len(k) <= 64):
            raise WireError(ErrorCode.INVALID_REQUEST, "meta keys are strings of 1-64 characters", "meta")
        ok = (isinstance(v, str) and len(v) <= 256) or isinstance(v, bool) or isinstance(v, int) or (
            isinstance(v, float) and math.isfinite(v))
        if not ok:
            raise WireError(ErrorCode.INVALID_REQUEST, f"meta.{k[:40]} must be a string (up to 256 characters), "
                            "a number or a boolean", f"meta.{k[:40]}")
    return Document(text, dict(meta), image, ref, mime)


def _image_of(obj: dict[str, Any]) -> tuple[bytes | None, str | None, str | None]:
    image, ref, mime = obj.get("image"), obj.get("ref"), obj.get("mime")
    if image is None and ref is None:
        return None, None, None
    if image is not None and ref is not None:
        raise WireError(ErrorCode.INVALID_REQUEST, "an image document has image bytes or a ref, not both", "ref")
    if image is not None and not (isinstance(image, bytes) and image):
        raise WireError(ErrorCode.INVALID_REQUEST, "image must be bytes (msgpack bin)", "image")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("redis:") and len(ref) <= 512):
        raise WireError(ErrorCode.INVALID_REQUEST, "ref must be a claim check, redis:<key>", "ref")
    if mime not in IMAGE_MIMES:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"an image document's mime is one of {', '.join(sorted(IMAGE_MIMES))}",
                        "mime")
    return image, ref, mime


def vector_key(tenant: str, collection: str, model: str, doc_id: str) -> bytes:
    return msgpack.packb([tenant, collection, model, doc_id])


def parse_vector_key(key: bytes | None) -> tuple[str, str, str, str] | None:
    """(tenant, collection, model, doc id), or None for a key the indexing stage did not make."""
    try:
        parts = msgpack.unpackb(key or b"", raw=False)
    except Exception:  # any bytes at all: a key we did not write is simply not ours
        return None
    if not (isinstance(parts, list) and len(parts) == 4 and all(isinstance(p, str) for p in parts)):
        return None
    return parts[0], parts[1], parts[2], parts[3]


@dataclass(frozen=True, slots=True)
class VectorRecord(WireMessage):
    """One document's embedding in one model's space, on ``<prefix>.vectors``."""

    tenant: str
    collection: str
    doc: str
    model: str
    """The encoder's identity (name/version/precision/preprocessing): indexes never mix spaces."""
    vector: dict[str, Any]
    """A wire tensor (``schemas.tensor``), unit length."""
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    source: list[int] = field(default_factory=list)
    """[partition, offset] of the document record it was made from."""

    VERSION = VERSION
    TYPE = "vector"
