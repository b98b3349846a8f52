"""Internal messages between stages, versioned like the public ones.

- ``EncodeJob`` on ``<prefix>.encode.<modality>.<lane>``: one part of one request.
- On ``<prefix>.encoded.<lane>``, keyed by ``request_key(tenant, id)`` so one assembler
  partition sees all of a request: ``Manifest`` (from the router: how many parts to wait for,
  where to reply), ``EncodedPart`` (from an encoder: the embedding or the part's error) and
  ``DeadlineTick`` (from the assembler's own sweep, so that deadline completion is handled in
  the stream).

Namespaces: a request is ``(tenant, id)``, never the id alone; the same id from two tenants
is two requests. Everything keyed per request between stages (these records' Kafka keys,
the assembler's and the generator's state, their done markers) uses ``request_key``. The
reply topic's events stay keyed by the bare id: that is the client's name for its request.

Trust: the router gives each request a random ``nonce``; it travels in every encode job and
the encoders copy it into their ``EncodedPart``. The assembler counts only parts that carry
a nonce of the request's manifest, so a part nobody in the pipeline made for this request
(a forged or stale record on the encoded topic) never completes it.

Every job carries ``sent_at_ms`` (when it was produced) and the spans of the stages before.
Maps are encoded and decoded from the fields by ``schemas.wire`` (its doc gives the key order
and the decoding rules); a new field goes at the end of its class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.wire import WireFormatError, WireMessage, omit_none

VERSION = 1


def request_key(tenant: str, rid: str) -> str:
    """The pipeline's name of one request: ``<tenant>/<id>`` (a tenant holds no ``/``)."""
    return f"{tenant}/{rid}"


class _Job(WireMessage):
    """Every internal job is a version-``VERSION`` map with a ``type``."""

    __slots__ = ()
    VERSION = VERSION


@dataclass(frozen=True, slots=True)
class EncodeJob(_Job):
    id: str
    part: int
    n_parts: int
    modality: str
    lane: str
    tenant: str
    deadline_at_ms: float
    sent_at_ms: float
    text: str | None = omit_none()
    data: bytes | None = omit_none()
    ref: str | None = omit_none()
    mime: str | None = omit_none()
    trace: list[Any] = field(default_factory=list)
    chunk: int | None = omit_none()
    """For a fanned-out part (a video's frames): which chunk of the part this job is."""
    nonce: str | None = omit_none()
    """The request's nonce (see the module doc): copied into this job's ``EncodedPart``."""
    ref_bytes: int | None = omit_none()
    """For a ``ref`` part: its stored size when the router priced it (bytes); the worker reads
    at most that many and refuses a payload that has grown since."""
    ref_pixels: int | None = omit_none()
    """For an image ``ref`` part: the pixels its header declared when the router priced it; the
    worker decodes no image with more (a claim check overwritten since with a larger picture of
    the same bytes is refused, not decoded at the old price)."""
    prep_ms: float | None = omit_none()
    """What the router priced the work before the engine at (an image's decode and resize, ms),
    where the modality prices it: the encoder prepares a job priced over
    ``encoder.heavy_prep_ms`` on a thread of lower CPU priority."""
    predicted_wait_ms: float | None = omit_none()
    """What the router predicted this job would wait at its stage before the engine starts it
    (ms, from the load reports, before any calibration): the encoder compares it with the wait
    it sees and reports how far such predictions run (``streams.policies.calibration``)."""
    background: bool | None = omit_none()
    """Part of a request admitted over its tenant's compute bucket (``Manifest.background``): a
    pool runs a batch of nothing else at lower CPU priority (``quota.debt_nice``). None: ordinary."""

    TYPE = "encode"

    @property
    def payload_bytes(self) -> int:
        """What this job holds in memory at most: its inline data and text, and a ref's priced size."""
        return len(self.data or b"") + len(self.text or "") + (self.ref_bytes or 0)


@dataclass(frozen=True, slots=True)
class Manifest(_Job):
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
    result_key: str | None = omit_none()
    """Where the assembler stores the whole answer for identical requests (reuse cache)."""
    nonce: str | None = omit_none()
    """Random, per routing of the request: parts without it are not this request's."""
    background: bool | None = omit_none()
    """A request admitted over its tenant's compute bucket (in debt): its encode jobs say so too
    (``EncodeJob.background``), and the generator and the pools run its work at lower CPU
    priority (``quota.debt_nice``). None: an ordinary request."""
    charged_tokens: int | None = omit_none()
    """The output tokens a generation was charged for (its ``max_tokens``), where the tenant's
    compute quota charged it: the generator gives back those it did not make. None: none charged."""
    charged_by: str | None = omit_none()
    """The router replica whose quota charged ``charged_tokens``: what is given back goes to that
    replica (each router keeps its own buckets). None: any router (a manifest of an older router)."""
    digest: str | None = omit_none()
    """Which ingress record this is (its bytes and timestamp, hashed): a replay of the same
    record has the same digest and changes nothing; another request with the same id
    has another and is refused (``invalid_request``: id already used)."""

    TYPE = "manifest"


@dataclass(frozen=True, slots=True)
class EncodedPart(_Job):
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
    n_chunks: int | None = omit_none()
    """Set on the header of a part that fans out (a video's frame chunks): how many chunk
    results the assembler waits for before it pools them into this part."""
    chunk: int | None = omit_none()
    """Set on one chunk's result: its index among the part's ``n_chunks``."""
    tenant: str | None = omit_none()
    """The request's tenant (from its encode job): with ``id``, which request this is."""
    nonce: str | None = omit_none()
    """The encode job's nonce, copied: the assembler drops a part whose nonce its
    request's manifest does not carry."""
    space: str | None = omit_none()
    """The identity of the encoder that made ``embedding`` (name/version/precision/
    preprocessing): which vector space it lives in. A retrieve stage searches only the
    documents embedded in the same space."""

    TYPE = "part"

    @property
    def is_header(self) -> bool:
        return self.n_chunks is not None and self.chunk is None and self.error is None


@dataclass(frozen=True, slots=True)
class DeadlineTick(_Job):
    id: str

    TYPE = "tick"


@dataclass(frozen=True, slots=True)
class Verdict(_Job):
    """The router's answer to a request that needs no encoding (a rejection, an invalid
    request it could still read an id from, a whole answer from the result cache). It goes
    to the assembler like a manifest, so that every event a client sees is sent by the one
    stage that keeps each request's state and answers it exactly once."""

    id: str
    tenant: str
    lane: str
    reply_to: str
    events: list[dict[str, Any]]
    """Event maps (schemas.events) to send in order; the last one is terminal."""
    sent_at_ms: float
    digest: str | None = omit_none()
    """As the manifest's: which ingress record this answers."""

    TYPE = "verdict"


FAN_IN_TYPES = {c.TYPE: c for c in (Manifest, EncodedPart, DeadlineTick, Verdict)}


def fan_in_from_wire(m: Any) -> Manifest | EncodedPart | DeadlineTick | Verdict:
    """Decode a message of the encoded topic; raises ``ValueError`` naming the field."""
    kind = m.get("type") if isinstance(m, dict) else None
    cls = FAN_IN_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        shown = repr(kind) if isinstance(kind, str) and len(kind) <= 40 else "none"
        raise WireFormatError(f"unknown fan-in message type {shown}", "type")
    return cls.from_wire(m)


@dataclass(frozen=True, slots=True)
class _RequestJob(_Job):
    """What every job carrying a whole request past the assembler says of it: who sent it, where
    its answers go, its deadline and when it was accepted, sent by the client and sent on here
    (the timing breakdown is built from these)."""

    id: str
    lane: str
    tenant: str
    reply_to: str
    deadline_at_ms: float
    accepted_at_ms: float
    client_sent_at_ms: float
    sent_at_ms: float


@dataclass(frozen=True, slots=True)
class GenerateJob(_RequestJob):
    """An assembled generate request, from the assembler to ``<prefix>.generate.<lane>``.

    ``parts`` say what each part became upstream, in request order: ``{"modality", "text"}``
    for text, ``{"modality", "labels": [[name, score], ...]}`` for an image, ``{"modality",
    "transcript"}`` for audio, ``{"modality", "frames": [[at_s, [[name, score], ...]], ...],
    "transcript"}`` for video, and ``{"modality", "failed": true}`` for a part that failed.
    """

    parts: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)
    trace: list[Any] = field(default_factory=list)
    """The per-stage breakdown so far: ``[{stage, queued_ms, service_ms}, ...]``."""
    background: bool | None = omit_none()
    """Admitted over its tenant's compute bucket (``Manifest.background``)."""
    charged_tokens: int | None = omit_none()
    """The output tokens it was charged for (``Manifest.charged_tokens``)."""
    charged_by: str | None = omit_none()
    """The router replica that charged them (``Manifest.charged_by``)."""
    passages: list[dict[str, Any]] | None = omit_none()
    """Retrieval-augmented: ``[{id, score, text}, ...]`` the retrieve stage found in
    ``params.collection``, in the order they go into the prompt (by id: the same passages
    give the same prompt prefix, whose KV the prefix cache reuses)."""

    TYPE = "generate"


@dataclass(frozen=True, slots=True)
class RetrieveJob(_RequestJob):
    """A search of one of the tenant's collections, from the assembler to
    ``<prefix>.retrieve.<lane>``, keyed by ``request_key``.

    ``query`` is the query part's embedding (a wire tensor) and ``modality`` its modality,
    for a ``retrieve`` request; a retrieval-augmented ``generate`` request carries its text
    instead (``query_text``: the retrieve stage embeds it with the text model the collection
    was indexed with) and the assembled ``generate`` job, which the retrieve stage sends on
    to the generator with the passages it found."""

    collection: str
    k: int
    where: dict[str, Any] | None = None
    modality: str = "text"
    query: dict[str, Any] | None = None
    query_text: str | None = None
    space: str | None = None
    """The encoder identity ``query`` was made by (None: the retrieve stage's text encoder's)."""
    generate: dict[str, Any] | None = None
    """The ``GenerateJob`` map to forward (RAG), or None: answer the client with the hits."""
    trace: list[Any] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)
    """What the assembler's result said of each part (index, modality, cache), for the answer."""

    TYPE = "retrieve"
