"""The request a client produces to ``<prefix>.ingress.<lane>``, and its validation.

Wire map (version 1)::

    {v: 1, id: str, tenant: str, task: "embed"|"generate"|"retrieve",
     parts: [{modality: "text"|"image"|"audio"|"video"|<a registered plugin's name>,
              text: str | data: bytes | ref: str, mime: str}],
     params: {max_tokens, temperature, stop: [str], stream: bool,
              collection: str, k: int, where: {key: scalar | [scalar]}},  # retrieve, RAG generate
     deadline_ms: int,     # budget in milliseconds from acceptance (not a wall-clock time)
     reply_to: str,        # topic for this request's events; default <prefix>.results
     lane: "rt"|"bulk"}

In JSON, ``data`` is base64 text. Every variable-length field has a limit; breaking one
raises ``WireError`` naming the field.

A modality is a short lowercase name (``MODALITY_NAME_RE``); which exist is the deployment's
registry (``workers/modalities``), handed to ``validate_request``. ``Modality`` names the
built-ins; a plugin's part carries its name as a plain string (only text parts carry ``text``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Collection

from schemas.errors import ErrorCode, WireError
from schemas.wire import ToWire, omit_none

VERSION = 1
# Claim checks: ``redis:<key>`` (bytes the SDK stored with a TTL under the tenant's own
# ``claim_prefix``) or ``file:///path`` (only under the tenant's folder of the one allowed).
REF_SCHEMES = ("redis:", "file://")


def claim_prefix(tenant: str) -> str:
    """The Redis keys a tenant's ``redis:`` refs may name (a tenant name holds no ``:``)."""
    return f"mm:claim:{tenant}:"


def claim_key(tenant: str, rid: str, index: int) -> str:
    """Where the SDK stores part ``index`` of request ``rid`` of ``tenant``."""
    return f"{claim_prefix(tenant)}{rid}:{index}"


class Task(StrEnum):
    EMBED = "embed"
    GENERATE = "generate"
    RETRIEVE = "retrieve"  # search a collection with one part's embedding (params.collection, k, where)


COLLECTION_RE = re.compile(r"[a-z0-9][a-z0-9_\-]{0,62}")
"""What a collection name looks like (``fullmatch``): it becomes part of a topic name
(``<prefix>.docs.<tenant>.<collection>``), so no ``.`` that would blur where the tenant ends."""


class Modality(StrEnum):
    """The built-in modalities (a deployment may register more: see ``MODALITY_NAME_RE``)."""

    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


MODALITY_NAME_RE = r"[a-z][a-z0-9]{0,31}"
"""What a modality name looks like: it becomes part of topic, stage and Kubernetes names."""


class Lane(StrEnum):
    RT = "rt"
    """Interactive traffic: consumed first at every stage."""
    BULK = "bulk"
    """Batch traffic: gets a bounded share of each cycle, shed first under load."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits applied by validation; the router builds them from its settings."""

    max_text_bytes: int = 64 * 1024
    max_parts: int = 16
    max_inline_bytes: int = 1024 * 1024
    max_deadline_ms: int = 600_000
    default_deadline_ms: int = 30_000
    max_id_chars: int = 128
    max_tenant_chars: int = 64
    max_topic_chars: int = 200
    max_ref_chars: int = 1024
    max_stop_strings: int = 8
    max_stop_chars: int = 64
    max_tokens: int = 1024
    max_k: int = 50
    default_k: int = 5
    rag_max_k: int = 8
    max_where_keys: int = 8
    max_where_values: int = 32
    max_where_chars: int = 200


@dataclass(frozen=True, slots=True)
class Part(ToWire):
    modality: str
    """A ``Modality`` (a ``StrEnum``, so a str) for the built-in ones, the plain name for a plugin's."""
    text: str | None = omit_none()
    data: bytes | None = omit_none()
    ref: str | None = omit_none()
    mime: str | None = omit_none()


@dataclass(frozen=True, slots=True)
class Params(ToWire):
    max_tokens: int = 64
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    stream: bool = True
    collection: str | None = omit_none()
    """The tenant's collection a retrieve request searches, or a generate request grounds its
    answer in (retrieval-augmented generation)."""
    k: int | None = omit_none()
    """How many hits (retrieve) or passages (generate); the deployment's default when None."""
    where: dict[str, Any] | None = omit_none()
    """Metadata filter: each key must equal the value (a list: any of them)."""


@dataclass(frozen=True, slots=True)
class Request(ToWire):
    """A request as the SDK builds it. Encoded by ``schemas.wire``; decoded only through
    ``validate_request``, which bounds every size and names the field it rejects."""

    id: str
    parts: tuple[Part, ...]
    task: Task = Task.EMBED
    tenant: str = "default"
    params: Params = field(default_factory=Params)
    deadline_ms: int | None = omit_none()
    reply_to: str | None = omit_none()
    lane: Lane = Lane.RT

    VERSION = VERSION
    WIRE_ORDER = ("id", "tenant", "task", "parts", "params", "lane", "deadline_ms", "reply_to")


_ID_RE = re.compile(r"[A-Za-z0-9._:\-]+")
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")
"""What a tenant name looks like (``fullmatch``): no ``:``, ``/`` or ``|``, which separate
the tenant from what follows it in namespaced keys (``<tenant>/<id>`` records,
``mm:claim:<tenant>:...``), and a letter or digit first (never ``.`` or ``..``, which are
directory names)."""
_TOPIC_RE = re.compile(r"[A-Za-z0-9._\-]+")
_MIME_RE = re.compile(r"[a-z0-9.+\-]+/[a-z0-9.+\-]+")
INTERNAL_MIME_MARK = "x-mm-"
"""Media types whose subtype starts with this are the pipeline's own (a video's frame chunk on
the image pool: ``video/x-mm-jpeg-frames``); a client's part may not claim one, or one
image part would buy a chunk of frames, each an inference, at the price of one image."""


def is_internal_mime(mime: str) -> bool:
    """Whether ``mime`` (parameters ignored, any case) is reserved for the pipeline's own jobs."""
    subtype = mime.split(";")[0].strip().lower().partition("/")[2]
    return subtype.startswith(INTERNAL_MIME_MARK)
_MODALITY_RE = re.compile(MODALITY_NAME_RE)
_BUILT_IN = frozenset(m.value for m in Modality)


def peek_reply(obj: Any) -> tuple[str, str | None] | None:
    """(id, reply_to) when a decoded-but-invalid request still says who to answer.

    Used to send an error event for a request that fails validation. Returns None when
    the id cannot be read, in which case nobody can be told and the message goes to the DLQ.
    """
    if not isinstance(obj, dict):
        return None
    rid, reply_to = obj.get("id"), obj.get("reply_to")
    if not isinstance(rid, str) or not rid or len(rid) > 128 or not _ID_RE.fullmatch(rid):
        return None
    if not (isinstance(reply_to, str) and _TOPIC_RE.fullmatch(reply_to) and len(reply_to) <= 200):
        reply_to = None
    return rid, reply_to


def validate_request(obj: dict[str, Any], limits: Limits, from_json: bool = False,
                     modalities: Collection[str] | None = None) -> Request:
    """Turn a decoded map into a ``Request`` or raise ``WireError`` naming the field.

    ``from_json`` makes ``data`` fields base64 text instead of bytes. ``modalities``: the
    names a part may use, in the order error messages list them (default: ``Modality``'s);
    any other fails the whole request with ``unsupported_media`` on ``parts.N.modality``.
    """
    known = tuple(m.value for m in Modality) if modalities is None else tuple(modalities)
    v = obj.get("v", VERSION)
    if v != VERSION:
        raise WireError(ErrorCode.INVALID_REQUEST, f"schema version {v!r} is not supported (this server speaks v{VERSION})", "v")
    rid = _string(obj, "id", limits.max_id_chars, required=True)
    if not _ID_RE.fullmatch(rid):  # fullmatch: `$` would let a trailing newline through
        raise WireError(ErrorCode.INVALID_REQUEST, "id may contain only letters, digits and . _ : -", "id")
    tenant = _string(obj, "tenant", limits.max_tenant_chars) or "default"
    if not TENANT_RE.fullmatch(tenant):
        raise WireError(ErrorCode.INVALID_REQUEST, "tenant may contain only letters, digits and . _ - "
                        "(a letter or digit first)", "tenant")
    task = _enum(obj, "task", Task, Task.EMBED)
    lane = _enum(obj, "lane", Lane, Lane.RT)
    reply_to = _string(obj, "reply_to", limits.max_topic_chars)
    if reply_to is not None and not _TOPIC_RE.fullmatch(reply_to):
        raise WireError(ErrorCode.INVALID_REQUEST, "reply_to is not a valid topic name", "reply_to")
    deadline_ms = obj.get("deadline_ms")
    if deadline_ms is not None:
        if not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool) or deadline_ms <= 0:
            raise WireError(ErrorCode.INVALID_REQUEST, "deadline_ms must be a positive integer (milliseconds)", "deadline_ms")
        if deadline_ms > limits.max_deadline_ms:
            raise WireError(ErrorCode.INVALID_REQUEST, f"deadline_ms may be at most {limits.max_deadline_ms}", "deadline_ms")
    raw_parts = obj.get("parts")
    if not isinstance(raw_parts, list) or not raw_parts:
        raise WireError(ErrorCode.INVALID_REQUEST, "parts must be a non-empty list", "parts")
    if len(raw_parts) > limits.max_parts:
        raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"at most {limits.max_parts} parts per request, got {len(raw_parts)}", "parts")
    parts = tuple(_part(p, f"parts.{i}", limits, from_json, known) for i, p in enumerate(raw_parts))
    params = _task_params(task, parts, _params(obj.get("params"), limits), limits)
    return Request(id=rid, parts=parts, task=task, tenant=tenant, params=params,
                   deadline_ms=deadline_ms, reply_to=reply_to, lane=lane)


def _task_params(task: Task, parts: tuple[Part, ...], params: Params, limits: Limits) -> Params:
    """The retrieval params checked against the task, ``k`` resolved: a retrieve request
    searches with exactly one part and names its collection; a generate request that names
    one is retrieval-augmented (its text is the question, at most ``rag_max_k`` passages);
    an embed request names none."""
    if task == Task.RETRIEVE:
        if len(parts) != 1:
            raise WireError(ErrorCode.INVALID_REQUEST, "a retrieve request has exactly one part: its query", "parts")
        if params.collection is None:
            raise WireError(ErrorCode.INVALID_REQUEST, "a retrieve request names its collection", "params.collection")
        return dataclasses.replace(params, k=params.k or min(limits.default_k, limits.max_k))
    if params.collection is None:
        if params.k is not None or params.where is not None:
            raise WireError(ErrorCode.INVALID_REQUEST, "k and where go with a collection", "params.collection")
        return params
    if task != Task.GENERATE:
        raise WireError(ErrorCode.INVALID_REQUEST, f"an {task} request does not search a collection (retrieve and "
                        "generate do)", "params.collection")
    if not any(p.modality == Modality.TEXT for p in parts):
        raise WireError(ErrorCode.INVALID_REQUEST, "a generate request with a collection needs a text part: the "
                        "question its passages are retrieved for", "parts")
    k = params.k or min(limits.default_k, limits.rag_max_k)
    if k > limits.rag_max_k:
        raise WireError(ErrorCode.INVALID_REQUEST, f"a generate request may ground itself in at most "
                        f"{limits.rag_max_k} passages", "params.k")
    return dataclasses.replace(params, k=k)


def _part(p: Any, where: str, limits: Limits, from_json: bool, known: tuple[str, ...]) -> Part:
    if not isinstance(p, dict):
        raise WireError(ErrorCode.INVALID_REQUEST, "each part must be a map", where)
    modality_raw = p.get("modality")
    if not (isinstance(modality_raw, str) and _MODALITY_RE.fullmatch(modality_raw) and modality_raw in known):
        raise WireError(
            ErrorCode.UNSUPPORTED_MEDIA,
            f"modality {modality_raw!r} is not one of {', '.join(known)}",
            f"{where}.modality",
        )
    modality: Modality | str = Modality(modality_raw) if modality_raw in _BUILT_IN else modality_raw
    mime = _string(p, "mime", 100, where=where)
    if mime is not None and not _MIME_RE.fullmatch(mime.lower()):
        raise WireError(ErrorCode.INVALID_REQUEST, f"mime {mime!r} is not a media type", f"{where}.mime")
    if mime is not None and is_internal_mime(mime):
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"mime {mime!r} is reserved for the pipeline's own jobs",
                        f"{where}.mime")
    given = [k for k in ("text", "data", "ref") if p.get(k) is not None]
    if len(given) != 1:
        raise WireError(ErrorCode.INVALID_REQUEST, "a part carries exactly one of text, data or ref", where)
    if modality is Modality.TEXT:
        if given[0] != "text":
            raise WireError(ErrorCode.INVALID_REQUEST, "a text part carries its content in `text`", where)
        text = p["text"]
        if not isinstance(text, str):
            raise WireError(ErrorCode.INVALID_REQUEST, "text must be a string", f"{where}.text")
        size = len(text.encode("utf-8"))
        if size > limits.max_text_bytes:
            raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"text is {size} bytes; the limit is {limits.max_text_bytes}", f"{where}.text")
        if not text.strip():
            raise WireError(ErrorCode.INVALID_REQUEST, "text is empty", f"{where}.text")
        return Part(modality, text=text, mime=mime)
    if given[0] == "text":
        raise WireError(ErrorCode.INVALID_REQUEST, f"a {modality} part carries `data` or `ref`, not `text`", where)
    if given[0] == "ref":
        ref = _string(p, "ref", limits.max_ref_chars, where=where)
        if not ref or not ref.startswith(REF_SCHEMES):
            raise WireError(ErrorCode.INVALID_REQUEST,
                            f"ref must start with one of {', '.join(REF_SCHEMES)} (a claim check)", f"{where}.ref")
        return Part(modality, ref=ref, mime=mime)
    data = p["data"]
    if from_json and isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise WireError(ErrorCode.INVALID_REQUEST, "data is not valid base64", f"{where}.data") from None
    if not isinstance(data, (bytes, bytearray)):
        raise WireError(ErrorCode.INVALID_REQUEST, "data must be bytes (base64 text in JSON)", f"{where}.data")
    if len(data) > limits.max_inline_bytes:
        raise WireError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"inline data is {len(data)} bytes; the limit is {limits.max_inline_bytes}: send it by ref",
            f"{where}.data",
        )
    return Part(modality, data=bytes(data), mime=mime)


def _params(raw: Any, limits: Limits) -> Params:
    if raw is None:
        return Params()
    if not isinstance(raw, dict):
        raise WireError(ErrorCode.INVALID_REQUEST, "params must be a map", "params")
    defaults = Params()
    max_tokens = raw.get("max_tokens", defaults.max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= limits.max_tokens:
        raise WireError(ErrorCode.INVALID_REQUEST, f"max_tokens must be an integer in 1..{limits.max_tokens}", "params.max_tokens")
    temperature = raw.get("temperature", defaults.temperature)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise WireError(ErrorCode.INVALID_REQUEST, "temperature must be a number in 0..2", "params.temperature")
    stop = raw.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > limits.max_stop_strings
            or not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stop)):
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"stop must be at most {limits.max_stop_strings} non-empty strings of up to {limits.max_stop_chars} characters",
            "params.stop",
        )
    stream = raw.get("stream", True)
    if not isinstance(stream, bool):
        raise WireError(ErrorCode.INVALID_REQUEST, "stream must be true or false", "params.stream")
    collection = raw.get("collection")
    if collection is not None and not (isinstance(collection, str) and COLLECTION_RE.fullmatch(collection)):
        raise WireError(ErrorCode.INVALID_REQUEST, "collection must be 1-63 of a-z 0-9 _ - (a letter or digit first)",
                        "params.collection")
    k = raw.get("k")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= limits.max_k):
        raise WireError(ErrorCode.INVALID_REQUEST, f"k must be an integer in 1..{limits.max_k}", "params.k")
    return Params(max_tokens=max_tokens, temperature=float(temperature), stop=tuple(stop), stream=stream,
                  collection=collection, k=k, where=_where(raw.get("where"), limits))


def _where(raw: Any, limits: Limits) -> dict[str, Any] | None:
    """A metadata filter: a map of up to ``max_where_keys`` keys, each to a scalar (str, int,
    float, bool) or a list of up to ``max_where_values`` of them; strings bounded."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > limits.max_where_keys:
        raise WireError(ErrorCode.INVALID_REQUEST, f"where must be a map of at most {limits.max_where_keys} keys",
                        "params.where")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and 0 < len(key) <= limits.max_where_chars):
            raise WireError(ErrorCode.INVALID_REQUEST, "where keys are non-empty strings", "params.where")
        values = value if isinstance(value, list) else [value]
        if not values or len(values) > limits.max_where_values or not all(_scalar(v, limits) for v in values):
            raise WireError(ErrorCode.INVALID_REQUEST,
                            f"where.{key[:40]} must be a string, number or boolean, or a list of up to "
                            f"{limits.max_where_values} of them", "params.where")
        out[key] = list(value) if isinstance(value, list) else value
    return out


def _scalar(v: Any, limits: Limits) -> bool:
    if isinstance(v, str):
        return len(v) <= limits.max_where_chars
    return isinstance(v, (bool, int, float)) and v == v  # NaN equals nothing: refused


def _string(obj: dict, name: str, max_chars: int, required: bool = False, where: str | None = None) -> str | None:
    path = f"{where}.{name}" if where else name
    value = obj.get(name)
    if value is None:
        if required:
            raise WireError(ErrorCode.INVALID_REQUEST, f"{name} is required", path)
        return None
    if not isinstance(value, str):
        raise WireError(ErrorCode.INVALID_REQUEST, f"{name} must be a string", path)
    if required and not value:
        raise WireError(ErrorCode.INVALID_REQUEST, f"{name} must not be empty", path)
    if len(value) > max_chars:
        raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"{name} is {len(value)} characters; the limit is {max_chars}", path)
    return value


def _enum(obj: dict, name: str, kind: type[StrEnum], default: StrEnum) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise WireError(ErrorCode.INVALID_REQUEST, f"{name} {value!r} is not one of {allowed}", name) from None
