"""Fan-in of one request's parts: a pure state machine over plain data.

The assembler stage keeps one ``Assembly`` per request (``<tenant>/<id>``) and feeds it every
message of the encoded topic. ``step`` returns the new state and, at most once per request,
the terminal event to send.

Duplicates are expected (every stage is at-least-once): a second manifest of the same
ingress record (same ``digest``), a part index already seen, or anything after completion
changes nothing. A manifest with another digest is another request reusing the id: it is
refused (``reused_id``: an ``invalid_request`` error for it), never merged into this one.
A completed request keeps a small tombstone for ``retention_ms`` so late duplicates cannot
start it again.

Parts count only when they carry a nonce of the request's manifest (``nonces``: the first
manifest's, plus a replayed manifest's, whose jobs carry their own): a part that arrived
before its manifest waits, and is dropped when the manifest comes without its nonce.

Before ``step``, ``intake`` decides what a message is to the stage as a whole (from what
the stage knows of its key, as plain data): a late duplicate, another request reusing an
id, the router's own answer, a request past the open-request bound, or one more message
for ``step``, and whether the oldest orphan makes room first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any


from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import DeadlineTick, EncodedPart, GenerateJob, Manifest, RetrieveJob, Verdict
from schemas.trace import Span, breakdown, spans_from_wire
from streams.policies.lifecycle import RequestStatus, advance
from streams.policies.pooling import pool_chunks
from workers import modalities

TERMINAL_SEQ = 1  # seq 0 is the router's `accepted`


@dataclass(frozen=True, slots=True)
class Assembly:
    status: RequestStatus
    first_seen_ms: float
    lane: str = "rt"
    """Lane of the topic the request's messages arrive on (where its deadline ticks go)."""
    manifest: Manifest | None = None
    parts: dict[int, EncodedPart] = field(default_factory=dict)
    """Finished parts (a fanned-out part lands here once its chunks are pooled)."""
    headers: dict[int, EncodedPart] = field(default_factory=dict)
    """Headers of fanned-out parts still waiting for chunks."""
    chunks: dict[int, dict[int, EncodedPart]] = field(default_factory=dict)
    done_at_ms: float | None = None
    nonces: frozenset[str] = frozenset()
    """Nonces of this request's manifests: a part with another is not this request's."""

    @property
    def done(self) -> bool:
        return self.done_at_ms is not None


@dataclass(frozen=True, slots=True)
class Step:
    state: Assembly | None
    """The new state; None means delete the entry."""
    emit: Event | None = None
    reply_to: str | None = None
    changed: bool = True
    forward: GenerateJob | RetrieveJob | None = None
    """For a generate task: the assembled job for the generator (which answers the client);
    for a retrieve task, or a generate task that names a collection: the search for the
    retrieve stage (which answers, or forwards the generate job with its passages)."""
    refused: Event | None = None
    """A manifest of another request with this one's id: its error (to its own reply_to)."""


@dataclass(frozen=True, slots=True)
class AssemblyPolicy:
    retention_ms: float = 120_000.0
    """How long a finished request's tombstone absorbs late duplicates."""
    orphan_ttl_ms: float = 600_000.0
    """How long parts without a manifest are kept before they are dropped."""


def step(state: Assembly | None, msg: Manifest | EncodedPart | DeadlineTick, now_ms: float,
         policy: AssemblyPolicy = AssemblyPolicy(), lane: str = "rt") -> Step:
    """Apply one fan-in message that arrived on ``lane``'s topic. Pure: the caller persists
    ``state`` and sends ``emit``."""
    if state is None:
        if isinstance(msg, DeadlineTick):
            return Step(None, changed=False)
        state = Assembly(status=RequestStatus.ACCEPTED, first_seen_ms=now_ms, lane=lane)
    if isinstance(msg, DeadlineTick):
        return _tick(state, now_ms, policy)
    if state.done:
        return Step(state, changed=False)
    if isinstance(msg, Manifest):
        if state.manifest is not None:
            if not same_record(state.manifest.digest, msg.digest):
                return Step(state, changed=False, refused=reused_id(msg, now_ms), reply_to=msg.reply_to)
            if msg.nonce is None or msg.nonce in state.nonces:
                return Step(state, changed=False)
            # The same ingress record routed again (the router replayed it): its jobs carry
            # this nonce, and any of their parts may be the first to come.
            return Step(replace(state, nonces=state.nonces | {msg.nonce}))
        state = replace(state, manifest=msg, status=advance(state.status, RequestStatus.ENCODING),
                        nonces=frozenset({msg.nonce}) if msg.nonce is not None else frozenset())
        if msg.nonce is not None:
            state = _only_trusted(state)
    elif isinstance(msg, EncodedPart):
        if msg.part in state.parts or (state.manifest and not 0 <= msg.part < state.manifest.n_parts):
            return Step(state, changed=False)
        if state.manifest is not None and not _trusted(state, msg):
            return Step(state, changed=False)  # not made by the pipeline for this request
        if msg.chunk is not None:
            have = state.chunks.get(msg.part, {})
            header = state.headers.get(msg.part)
            if msg.chunk in have or msg.chunk < 0 or (header is not None and msg.chunk >= (header.n_chunks or 0)):
                return Step(state, changed=False)
            state = replace(state, chunks={**state.chunks, msg.part: {**have, msg.chunk: msg}})
        elif msg.is_header:
            if msg.part in state.headers:
                return Step(state, changed=False)
            state = replace(state, headers={**state.headers, msg.part: msg})
        else:
            state = replace(state, parts={**state.parts, msg.part: msg})
        if state.manifest is not None:  # before it, the chunks' nonces cannot be checked yet
            state = _pool_if_complete(state, msg.part)
    if state.manifest is not None and len(state.parts) >= state.manifest.n_parts:
        return _complete(state, now_ms, deadline_hit=False)
    return Step(state)


class Intake(StrEnum):
    """What a fan-in message is to the assembler, before its request's ``step``."""

    IGNORE = "ignore"
    """Nothing to do but finish its record: a deadline tick from an older version, a late
    duplicate of an answered request, or the router's answer to a replay of a request
    already open (the first answer stands)."""
    REUSED_ID = "reused_id"
    """Another request (another ingress record) with the id of one open or just answered: it
    gets its own ``invalid_request``; the other is not touched."""
    VERDICT = "verdict"
    """The router's own answer (an error, or a whole cached answer): its events go out."""
    OVERLOADED = "overloaded"
    """It would open a request while ``max_pending`` are open: answered ``overloaded``."""
    STEP = "step"
    """Into its request's state machine (``step``)."""


@dataclass(frozen=True, slots=True)
class KeyView:
    """What the stage knows of one request key, as plain data."""

    answered: bool = False
    """Answered recently (a tombstone)."""
    answered_digest: str | None = None
    """The ingress record it answered, when known."""
    tracked: bool = False
    """An entry is open for it (with or without its manifest)."""
    manifest_digest: str | None = None
    """The open entry's manifest's record (``has_manifest``: it has one)."""
    has_manifest: bool = False
    open_requests: int = 0
    """Open requests with their manifest, over every partition of the replica."""
    orphans: int = 0
    """Open entries without a manifest, over every partition."""


@dataclass(frozen=True, slots=True)
class IntakeDecision:
    action: Intake
    opens: bool = False
    """It is the manifest that opens its request (its deadline starts counting)."""
    evict_orphan: bool = False
    """The oldest orphan goes first (``max_orphans`` reached by a new one)."""


def intake(msg: Any, view: KeyView, max_pending: int, max_orphans: int) -> IntakeDecision:
    """What to do with ``msg`` (a ``Manifest``, ``Verdict``, ``EncodedPart`` or
    ``DeadlineTick``) given ``view`` of its key. Pure."""
    if isinstance(msg, DeadlineTick):
        return IntakeDecision(Intake.IGNORE)  # the stage's own sweep keeps the deadlines
    record = isinstance(msg, (Manifest, Verdict))
    if view.answered:
        if record and not same_record(view.answered_digest, msg.digest):
            return IntakeDecision(Intake.REUSED_ID)
        return IntakeDecision(Intake.IGNORE)
    if isinstance(msg, Verdict):
        if view.has_manifest:  # the router answered a record while a request with its key is open
            same = same_record(view.manifest_digest, msg.digest)
            return IntakeDecision(Intake.IGNORE if same else Intake.REUSED_ID)
        return IntakeDecision(Intake.VERDICT)
    opens = isinstance(msg, Manifest) and not view.has_manifest
    if opens and view.open_requests >= max_pending:
        return IntakeDecision(Intake.OVERLOADED, opens=True)
    evict = not view.tracked and not isinstance(msg, Manifest) and view.orphans >= max_orphans
    return IntakeDecision(Intake.STEP, opens=opens, evict_orphan=evict)


def same_record(a: str | None, b: str | None) -> bool:
    """Whether two digests can name the same ingress record (a missing one, from an older
    router, cannot tell them apart: treated as the same, as before digests)."""
    return a is None or b is None or a == b


def accepted_event(m: Manifest) -> Event:
    """A request's ``accepted`` event (seq 0), from its manifest."""
    return Event(m.id, EventKind.ACCEPTED, 0, m.accepted_at_ms,
                 payload={"task": m.task, "parts": m.n_parts, "deadline_at_ms": m.deadline_at_ms})


def reused_id(m: Manifest, now_ms: float) -> Event:
    """The answer to a request that reuses the id of another of its tenant's requests
    (open, or answered less than ``retention_ms`` ago)."""
    err = WireError(ErrorCode.INVALID_REQUEST,
                    "id already used by another request of this tenant (still open or recently answered): "
                    "send each request with a new id", "id")
    return Event(m.id, EventKind.ERROR, 0, now_ms, error=err.to_wire())


def _trusted(state: Assembly, part: EncodedPart) -> bool:
    """Whether ``part`` carries a nonce of the request's manifests (a manifest without a
    nonce, from an older router, trusts every part as before)."""
    m = state.manifest
    return m is None or m.nonce is None or (part.nonce is not None and part.nonce in state.nonces)


def _only_trusted(state: Assembly) -> Assembly:
    """The state without the parts that came before the manifest and do not carry its nonce."""
    n_parts = state.manifest.n_parts if state.manifest is not None else 0

    def keep(parts: dict[int, EncodedPart]) -> dict[int, EncodedPart]:
        return {i: p for i, p in parts.items() if _trusted(state, p) and 0 <= i < n_parts}

    chunks = {i: {k: c for k, c in cs.items() if _trusted(state, c)} for i, cs in state.chunks.items()
              if 0 <= i < n_parts}
    state = replace(state, parts=keep(state.parts), headers=keep(state.headers),
                    chunks={i: cs for i, cs in chunks.items() if cs})
    for i in list(state.headers):
        state = _pool_if_complete(state, i)
    return state


def _pool_if_complete(state: Assembly, part: int) -> Assembly:
    header = state.headers.get(part)
    chunks = state.chunks.get(part, {})
    if header is None or header.n_chunks is None or len(chunks) < header.n_chunks:
        return state
    pooled = pool_chunks(header, chunks, complete=True)
    headers = {i: h for i, h in state.headers.items() if i != part}
    rest = {i: c for i, c in state.chunks.items() if i != part}
    return replace(state, parts={**state.parts, part: pooled}, headers=headers, chunks=rest)


def _tick(state: Assembly, now_ms: float, policy: AssemblyPolicy) -> Step:
    if state.done:
        expired = now_ms - (state.done_at_ms or 0) >= policy.retention_ms
        return Step(None) if expired else Step(state, changed=False)
    if state.manifest is None:
        expired = now_ms - state.first_seen_ms >= policy.orphan_ttl_ms
        return Step(None) if expired else Step(state, changed=False)
    if now_ms >= state.manifest.deadline_at_ms:
        return _complete(state, now_ms, deadline_hit=True)
    return Step(state, changed=False)


def due_at(state: Assembly, policy: AssemblyPolicy = AssemblyPolicy()) -> float:
    """Epoch ms from which a tick changes this state (the sweep sends ticks only then)."""
    if state.done:
        return (state.done_at_ms or 0) + policy.retention_ms
    if state.manifest is None:
        return state.first_seen_ms + policy.orphan_ttl_ms
    return state.manifest.deadline_at_ms


def _complete(state: Assembly, now_ms: float, deadline_hit: bool) -> Step:
    m = state.manifest
    assert m is not None  # callers check; a bug otherwise, not input
    timeout = WireError(ErrorCode.DEADLINE_EXCEEDED, "the part was not encoded before the request's deadline")
    results: list[dict[str, Any]] = []
    for i in range(m.n_parts):
        p = state.parts.get(i)
        if p is None and i in state.headers:  # the deadline came first: pool what is there
            p = pool_chunks(state.headers[i], state.chunks.get(i, {}), complete=False)
        if p is None:
            results.append({"index": i, "modality": m.modalities[i], "embedding": None,
                            "error": timeout.to_wire(), "extras": {}, "cache": None})
        else:
            results.append({"index": i, "modality": p.modality, "embedding": p.embedding,
                            "error": p.error, "extras": p.extras, "cache": p.cache})
    failed = [r for r in results if r["error"] is not None]
    timings = _timings(state, now_ms)
    cache = {"hits": sum(r["cache"] == "hit" for r in results), "misses": sum(r["cache"] == "miss" for r in results)}
    if m.task == "generate" and len(failed) < len(results):
        job = GenerateJob(id=m.id, lane=m.lane, tenant=m.tenant, reply_to=m.reply_to, deadline_at_ms=m.deadline_at_ms,
                          accepted_at_ms=m.accepted_at_ms, client_sent_at_ms=m.client_sent_at_ms, sent_at_ms=now_ms,
                          parts=[_grounding(r) for r in results], params=m.params,
                          trace=timings["stages"], background=m.background, charged_tokens=m.charged_tokens,
                          charged_by=m.charged_by)
        done = replace(state, status=advance(state.status, RequestStatus.FORWARDED), done_at_ms=now_ms)
        if m.params.get("collection"):  # retrieval-augmented: the question's text searches first
            question = "\n".join(p.get("text", "") for p in job.parts if p.get("modality") == "text").strip()
            return Step(done, forward=_search(m, now_ms, timings, query_text=question or " ", generate=job.to_wire()))
        return Step(done, forward=job)
    if m.task == "retrieve" and not failed and results and results[0]["embedding"] is not None:
        done = replace(state, status=advance(state.status, RequestStatus.FORWARDED), done_at_ms=now_ms)
        parts = [{"index": r["index"], "modality": r["modality"], "cache": r["cache"]} for r in results]
        return Step(done, forward=_search(m, now_ms, timings, query=results[0]["embedding"],
                                          modality=results[0]["modality"], space=_space(state, 0), parts=parts))
    if len(failed) == len(results):
        status = RequestStatus.DEADLINE_EXCEEDED if deadline_hit and not state.parts else RequestStatus.FAILED
        error = _summary_error(failed, deadline_hit and not state.parts)
        event = Event(m.id, EventKind.ERROR, TERMINAL_SEQ, now_ms, payload={"task": m.task, "parts": results},
                      error=error.to_wire(), timings=timings, cache=cache)
    else:
        status = RequestStatus.FINISHED_PARTIAL if failed else RequestStatus.FINISHED
        event = Event(m.id, EventKind.RESULT, TERMINAL_SEQ, now_ms,
                      payload={"task": m.task, "partial": bool(failed), "parts": results},
                      timings=timings, cache=cache)
    done = replace(state, status=advance(state.status, status), done_at_ms=now_ms)
    return Step(done, emit=event, reply_to=m.reply_to)


def _space(state: Any, i: int) -> str | None:
    """The encoder identity that embedded part ``i`` (None when the part did not say)."""
    p = state.parts.get(i)
    return p.space if p is not None else None


def _search(m: Manifest, now_ms: float, timings: dict[str, Any], **what: Any) -> RetrieveJob:
    """The retrieve stage's job for request ``m`` (``what``: its query, and for RAG the
    generate job to forward); ``k`` was resolved by the router."""
    p = m.params
    return RetrieveJob(id=m.id, lane=m.lane, tenant=m.tenant, reply_to=m.reply_to, deadline_at_ms=m.deadline_at_ms,
                       accepted_at_ms=m.accepted_at_ms, client_sent_at_ms=m.client_sent_at_ms, sent_at_ms=now_ms,
                       collection=str(p.get("collection")), k=int(p.get("k") or 1), where=p.get("where"),
                       trace=timings["stages"], **what)


def _grounding(r: dict[str, Any]) -> dict[str, Any]:
    """What the language model is told about one part: its modality's ``grounding`` of the
    part's extras (workers/modalities), or only that it failed. The generator turns it into
    a prompt part (workers/prompt.py)."""
    out: dict[str, Any] = {"modality": r["modality"]}
    spec = modalities.get(r["modality"])
    if r.get("error") is not None:
        out["failed"] = True
    elif spec is not None:
        out.update(spec.grounding(r.get("extras") or {}))
    return out


def _summary_error(failed: list[dict[str, Any]], deadline: bool) -> WireError:
    if deadline:
        return WireError(ErrorCode.DEADLINE_EXCEEDED, "no part was encoded before the request's deadline")
    codes = [ErrorCode(r["error"]["code"]) for r in failed]
    detail = "; ".join(f"part {r['index']} ({r['modality']}): {r['error']['code']}: {r['error']['message']}" for r in failed)
    code = codes[0] if len(set(codes)) == 1 else ErrorCode.INVALID_REQUEST
    if ErrorCode.INTERNAL in codes:
        code = ErrorCode.INTERNAL
    # One code for every part (an overloaded encoder): the longest wait a part was told to keep.
    waits = [r["error"].get("retry_after_ms") for r in failed] if len(set(codes)) == 1 else []
    retry = max((int(w) for w in waits if isinstance(w, (int, float)) and 0 <= w < 86_400_000), default=None)
    return WireError(code, f"every part failed: {detail}", None, retry)


def _timings(state: Assembly, now_ms: float) -> dict[str, Any]:
    m = state.manifest
    assert m is not None
    router = spans_from_wire(m.trace)
    parts = sorted(state.parts.values(), key=lambda p: p.sent_at_ms)
    critical = parts[-1] if parts else None
    stages: list[Span] = list(router)
    if critical is not None:
        stages += spans_from_wire(critical.trace)
        last_sent = critical.sent_at_ms
    else:
        last_sent = m.sent_at_ms
    stages.append(Span("assemble", last_sent, now_ms, now_ms))
    return {
        "e2e_ms": round(now_ms - m.client_sent_at_ms, 3),
        "accepted_at_ms": m.accepted_at_ms,
        "stages": breakdown(stages),
        # Per part: the breakdown, and the raw spans (epoch ms) so a client can see which
        # parts of its request ran at the same time.
        "parts": [{"index": p.part, "modality": p.modality, "stages": breakdown(spans_from_wire(p.trace)),
                   "spans": p.trace}
                  for p in sorted(state.parts.values(), key=lambda p: p.part)],
    }
