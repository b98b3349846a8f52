"""Internal messages between stages, versioned like the public ones.

- ``EncodeJob`` on ``<prefix>.encode.<modality>.<lane>``: one part of one request.
- On ``<prefix>.encoded.<lane>``, keyed by request id so one assembler partition sees all of
  a request: ``Manifest`` (from the router: how many parts to wait for, where to reply),
  ``EncodedPart`` (from an encoder: the embedding or the part's error) and ``DeadlineTick``
  (from the assembler's own sweep, so that deadline completion is handled in the stream).

Every job carries ``sent_at_ms`` (when it was produced) and the spans of the stages before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VERSION = 1


def _base(kind: str) -> dict[str, Any]:
    return {"v": VERSION, "type": kind}


def _check(m: dict[str, Any], kind: str) -> None:
    if m.get("v") != VERSION or m.get("type") != kind:
        raise ValueError(f"expected a v{VERSION} {kind}, got v={m.get('v')!r} type={m.get('type')!r}")


@dataclass(frozen=True, slots=True)
class EncodeJob:
    id: str
    part: int
    n_parts: int
    modality: str
    lane: str
    tenant: str
    deadline_at_ms: float
    sent_at_ms: float
    text: str | None = None
    data: bytes | None = None
    ref: str | None = None
    mime: str | None = None
    trace: list[Any] = field(default_factory=list)
    chunk: int | None = None
    """For a fanned-out part (a video's frames): which chunk of the part this job is."""

    TYPE = "encode"

    def to_wire(self) -> dict[str, Any]:
        m = _base(self.TYPE)
        m.update(id=self.id, part=self.part, n_parts=self.n_parts, modality=self.modality, lane=self.lane,
                 tenant=self.tenant, deadline_at_ms=self.deadline_at_ms, sent_at_ms=self.sent_at_ms,
                 trace=self.trace)
        for name in ("text", "data", "ref", "mime", "chunk"):
            value = getattr(self, name)
            if value is not None:
                m[name] = value
        return m

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> "EncodeJob":
        _check(m, cls.TYPE)
        try:
            return cls(id=str(m["id"]), part=int(m["part"]), n_parts=int(m["n_parts"]), modality=str(m["modality"]),
                       lane=str(m["lane"]), tenant=str(m["tenant"]), deadline_at_ms=float(m["deadline_at_ms"]),
                       sent_at_ms=float(m["sent_at_ms"]), text=m.get("text"), data=m.get("data"),
                       ref=m.get("ref"), mime=m.get("mime"), trace=list(m.get("trace") or []),
                       chunk=None if m.get("chunk") is None else int(m["chunk"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed encode job: {exc}") from None


@dataclass(frozen=True, slots=True)
class Manifest:
    id: str
    task: str
    tenant: str
    lane: str
    reply_to: str
    n_parts: int
    modalities: list[str]
    deadline_at_ms: float
    accepted_at_ms: float
    client_sent_at_ms: float
    sent_at_ms: float
    params: dict[str, Any] = field(default_factory=dict)
    trace: list[Any] = field(default_factory=list)
    result_key: str | None = None
    """Where the assembler stores the whole answer for identical requests (reuse cache)."""

    TYPE = "manifest"

    def to_wire(self) -> dict[str, Any]:
        m = _base(self.TYPE)
        m.update(id=self.id, task=self.task, tenant=self.tenant, lane=self.lane, reply_to=self.reply_to,
                 n_parts=self.n_parts, modalities=self.modalities, deadline_at_ms=self.deadline_at_ms,
                 accepted_at_ms=self.accepted_at_ms, client_sent_at_ms=self.client_sent_at_ms,
                 sent_at_ms=self.sent_at_ms, params=self.params, trace=self.trace)
        if self.result_key is not None:
            m["result_key"] = self.result_key
        return m

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> "Manifest":
        _check(m, cls.TYPE)
        try:
            return cls(id=str(m["id"]), task=str(m["task"]), tenant=str(m["tenant"]), lane=str(m["lane"]),
                       reply_to=str(m["reply_to"]), n_parts=int(m["n_parts"]), modalities=list(m["modalities"]),
                       deadline_at_ms=float(m["deadline_at_ms"]), accepted_at_ms=float(m["accepted_at_ms"]),
                       client_sent_at_ms=float(m["client_sent_at_ms"]), sent_at_ms=float(m["sent_at_ms"]),
                       params=dict(m.get("params") or {}), trace=list(m.get("trace") or []),
                       result_key=m.get("result_key"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from None


@dataclass(frozen=True, slots=True)
class EncodedPart:
    id: str
    part: int
    modality: str
    sent_at_ms: float
    embedding: dict[str, Any] | None = None
    """A wire tensor (schemas.tensor) or None when the part failed."""
    error: dict[str, Any] | None = None
    """A WireError map when the part failed; the other parts of the request still count."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Modality-specific outputs users want beside the embedding (labels, transcript)."""
    cache: str | None = None
    """'hit' or 'miss' when the reuse cache was consulted."""
    trace: list[Any] = field(default_factory=list)
    n_chunks: int | None = None
    """Set on the header of a part that fans out (a video's frame chunks): how many chunk
    results the assembler waits for before it pools them into this part."""
    chunk: int | None = None
    """Set on one chunk's result: its index among the part's ``n_chunks``."""

    TYPE = "part"

    @property
    def is_header(self) -> bool:
        return self.n_chunks is not None and self.chunk is None and self.error is None

    def to_wire(self) -> dict[str, Any]:
        m = _base(self.TYPE)
        m.update(id=self.id, part=self.part, modality=self.modality, sent_at_ms=self.sent_at_ms,
                 embedding=self.embedding, error=self.error, extras=self.extras, cache=self.cache,
                 trace=self.trace)
        if self.n_chunks is not None:
            m["n_chunks"] = self.n_chunks
        if self.chunk is not None:
            m["chunk"] = self.chunk
        return m

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> "EncodedPart":
        _check(m, cls.TYPE)
        try:
            return cls(id=str(m["id"]), part=int(m["part"]), modality=str(m["modality"]),
                       sent_at_ms=float(m["sent_at_ms"]), embedding=m.get("embedding"), error=m.get("error"),
                       extras=dict(m.get("extras") or {}), cache=m.get("cache"), trace=list(m.get("trace") or []),
                       n_chunks=None if m.get("n_chunks") is None else int(m["n_chunks"]),
                       chunk=None if m.get("chunk") is None else int(m["chunk"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed encoded part: {exc}") from None


@dataclass(frozen=True, slots=True)
class DeadlineTick:
    id: str

    TYPE = "tick"

    def to_wire(self) -> dict[str, Any]:
        m = _base(self.TYPE)
        m["id"] = self.id
        return m

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> "DeadlineTick":
        _check(m, cls.TYPE)
        return cls(id=str(m["id"]))


FAN_IN_TYPES = {c.TYPE: c for c in (Manifest, EncodedPart, DeadlineTick)}


def fan_in_from_wire(m: dict[str, Any]) -> Manifest | EncodedPart | DeadlineTick:
    """Decode a message of the encoded topic; raises ``ValueError`` for unknown types."""
    cls = FAN_IN_TYPES.get(m.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown fan-in message type {m.get('type')!r}")
    return cls.from_wire(m)


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """An assembled generate request, from the assembler to ``<prefix>.generate.<lane>``.

    ``parts`` say what each part became upstream, in request order: ``{"modality", "text"}``
    for text, ``{"modality", "labels": [[name, score], ...]}`` for an image, ``{"modality",
    "transcript"}`` for audio, ``{"modality", "frames": [[at_s, [[name, score], ...]], ...],
    "transcript"}`` for video, and ``{"modality", "failed": true}`` for a part that failed.
    """

    id: str
    lane: str
    tenant: str
    reply_to: str
    deadline_at_ms: float
    accepted_at_ms: float
    client_sent_at_ms: float
    sent_at_ms: float
    parts: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)
    trace: list[Any] = field(default_factory=list)
    """The per-stage breakdown so far: ``[{stage, queued_ms, service_ms}, ...]``."""

    TYPE = "generate"

    def to_wire(self) -> dict[str, Any]:
        m = _base(self.TYPE)
        m.update(id=self.id, lane=self.lane, tenant=self.tenant, reply_to=self.reply_to,
                 deadline_at_ms=self.deadline_at_ms, accepted_at_ms=self.accepted_at_ms,
                 client_sent_at_ms=self.client_sent_at_ms, sent_at_ms=self.sent_at_ms, parts=self.parts,
                 params=self.params, trace=self.trace)
        return m

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> "GenerateJob":
        _check(m, cls.TYPE)
        try:
            return cls(id=str(m["id"]), lane=str(m["lane"]), tenant=str(m["tenant"]), reply_to=str(m["reply_to"]),
                       deadline_at_ms=float(m["deadline_at_ms"]), accepted_at_ms=float(m["accepted_at_ms"]),
                       client_sent_at_ms=float(m["client_sent_at_ms"]), sent_at_ms=float(m["sent_at_ms"]),
                       parts=[dict(p) for p in m["parts"]], params=dict(m.get("params") or {}),
                       trace=list(m.get("trace") or []))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed generate job: {exc}") from None
