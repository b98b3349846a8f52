"""What the router does with one ingress record (``Router.handle``): decode, validate, price,
shed or admit, and split into a manifest and per-part encode jobs. The router stage
(``streams.stages.router``) polls the records and sends what this returns.

Everything a message can do wrong ends here as an answer, never as a crashed stage: bytes no
one can be answered for go to the DLQ (original headers, the reason); a request that breaks
the schema gets an ``error`` event.

Who a request is from. With a PLAINTEXT broker every client is trusted: requests arrive on
the shared ingress topics and the tenant is the payload's ``tenant``. With an
authenticating broker (``KafkaSettings.authenticated``) the router also reads every
tenant's ingress topic ``<p>.ingress.<lane>.<tenant>`` (a pattern subscription), which only
that tenant's principal may write (ACLs): the tenant is the one the topic names. A payload
``tenant`` that differs is refused (``invalid_request``, field ``tenant``); an absent one
is filled in. The shared ingress topics stay, writable by the service principal alone, and
there the payload's tenant is believed (operators' tools, probes).

Where answers go (``reply_to``): never to an internal topic (``TopicNames.is_internal``: the
ingress, encode, encoded, generate, done and DLQ topics, changelogs) in any mode; a tenant's
request only inside its own reply namespace (``<p>.results.<tenant>`` by default, or an
existing ``<p>.results.<tenant>.*``). A refused ``reply_to`` is answered with an error on
the default reply topic of whoever sent it.

Every record the router sends for a request is keyed ``<tenant>/<id>`` (``request_key``),
names the ingress record (``digest``: a replay of it is recognised downstream, another
request reusing the id is refused) and carries a fresh ``nonce`` that the request's parts
must carry back (``schemas.jobs``). Before admission, the tenant's quota
(``streams.policies.quota``) may shed the request with ``overloaded``.

Refs are priced at their stored size before anything reads them (``workers.claims.ClaimSizer``,
injected as ``ref_sizes``): a part whose ref is unknown, not the tenant's or over
``limits.max_ref_bytes`` fails alone, here; a request whose refs name more than
``limits.max_request_ref_bytes`` together is ``payload_too_large``; the tenant's byte bucket
(``quota.ref_bytes_per_s``) sheds the rest. Each job carries its ref's priced size, and the
worker reads no more. Without a sizer every ref is priced at the most it may read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NamedTuple, Sequence

from schemas.codec import CONTENT_TYPE_HEADER, JSON, DecodeError, header, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import Manifest, Verdict, request_key
from schemas.request import TENANT_RE, Limits, peek_reply, validate_request
from schemas.settings import Settings, parse_quota_overrides
from schemas.topics import TopicNames
from schemas.trace import now_ms
from streams.policies.admission import IDLE_SHARE, AdmissionLimits, Admit, Reject, admit
from streams.policies.budget import KeyedBudget
from streams.policies.gen_price import ROUTER_GEN_COST, estimate_prompt_tokens, price_generate_ms, token_price_ms
from streams.policies.load import LoadView, stage_of
from streams.policies.partitioning import Partitioner
from streams.policies.quota import QuotaLimits, Shed, TenantQuotas
from streams.policies.split import RoutedJob, split_request
from streams.reply_topics import ReplyTopics
from streams.runtime.produce import Out, dead_letter, out_map
from streams.runtime.stage import bounded, raised_at
from workers import modalities
from workers.cache_keys import content_digest, result_key
from workers.claims import ClaimSize
from workers.text import normalize

log = logging.getLogger(__name__)

TEXT_MAX_TOKENS = 256.0
# (part index, ref) pairs, the tenant, the parts whose head is wanted -> per part its size and
# head, or error (``ClaimSizer.sizes``).
RefSizes = Callable[[Sequence[tuple[int, str]], str, frozenset[int]], Awaitable[dict[int, "ClaimSize | WireError"]]]


class Price(NamedTuple):
    """One part's price: the stage whose engine it loads and its predicted ms there, of which
    ``prep_ms`` is the work before the engine (an image's decode; 0 where none is priced)."""

    stage: str
    ms: float
    prep_ms: float = 0.0
    also: tuple[tuple[str, float], ...] = ()
    """(stage, ms) of the work the part causes in other pools (a video's soundtrack at the
    audio pool): counted in admission there and in the tenant's compute."""


Priced = Price | None
"""A part's price, None for a part that makes no job."""


def limits_from(settings: Settings) -> Limits:
    lim = settings.limits
    return Limits(max_text_bytes=lim.max_text_bytes, max_parts=lim.max_parts, max_inline_bytes=lim.max_inline_bytes,
                  max_deadline_ms=lim.max_deadline_ms, default_deadline_ms=lim.default_deadline_ms,
                  max_k=settings.retrieval.max_k, default_k=settings.retrieval.default_k,
                  rag_max_k=settings.retrieval.rag_max_k, max_where_keys=settings.retrieval.max_where_keys)


@dataclass(frozen=True, slots=True)
class Routed:
    """What the router produces for one ingress record, and how it went (for metrics)."""

    outs: list[Out]
    outcome: str
    """``ok`` (accepted and split), ``error`` (answered with an error event) or ``dlq``."""
    code: str | None = None
    modality: str = "text"
    lane: str = "rt"
    queued_ms: float = 0.0
    service_ms: float = 0.0
    admission: str | None = None
    """``admit`` or ``reject`` when admission decided; None when it was off or not reached."""
    shed: tuple[str, str] | None = None
    """(tenant, reason) when the tenant's quota shed the request."""
    jobs: tuple["JobOut", ...] = ()
    """The encode jobs among ``outs``: a co-located encoder may take them over in process."""
    key: str | None = None
    """The request's key (``<tenant>/<id>``) where its records name one."""
    digest: str | None = None
    """The ingress record's digest (``record_digest``) where its records name one."""
    manifest: Manifest | None = None
    """An admitted request's manifest (the first of ``outs``)."""
    parked: str | None = None
    """``dlq`` or ``dlq_dropped`` for a record answered (``error``) and dead-lettered too, or
    past its tenant's DLQ budget not dead-lettered (a routing bug, ``Router._failed``)."""

    @property
    def for_want_of_capacity(self) -> bool:
        """Refused because a stage it needs has its lane's limit of work queued: the engines
        are full (a tenant's quota shed is not this)."""
        return self.admission == "reject" and self.shed is None and self.code == ErrorCode.OVERLOADED


@dataclass(frozen=True, slots=True)
class JobOut:
    job: RoutedJob
    out: Out  # its record in ``Routed.outs``
    cost_ms: float  # its predicted engine time


class Router:
    """Turns one ingress record into the records to produce. No I/O of its own except the
    reply-topic existence check, which is injected."""

    def __init__(self, settings: Settings, topic_exists: Callable[[str], Awaitable[bool]],
                 load: LoadView | None = None, results: Any = None,
                 nonce: Callable[[], str] = lambda: secrets.token_hex(12), ref_sizes: RefSizes | None = None) -> None:
        self.settings = settings
        self.topics = TopicNames(settings.kafka.topic_prefix)
        self.limits = limits_from(settings)
        self.known_modalities = tuple(modalities.names())
        """What a part may say it is: the registry (plugins loaded) when the router starts."""
        self.served_modalities = modalities.served(settings)
        self.served_tasks = frozenset(t.strip() for t in settings.router.served_tasks.split(",") if t.strip())
        self.replies = ReplyTopics(self.topics, topic_exists)
        self.load = load if load is not None else LoadView()
        self.partitioner = Partitioner(settings.router.partitioner)
        self.results = results
        """A ResultCache (streams/stores/result_cache.py), or None: no whole-result reuse."""
        self.models: dict[str, str] = {}
        """modality -> model identity, as the encoders publish them (refreshed by the stage)."""
        self.gen_cost = ROUTER_GEN_COST
        """What a generate request is priced with: the dearest step cost the generators
        publish (refreshed by the stage; ``streams.policies.gen_price``)."""
        a = settings.admission
        self.admission = AdmissionLimits(a.max_queued_ms_rt, a.max_queued_ms_bulk) if a.enabled else None
        self.lane_limit_ms = {"rt": a.max_queued_ms_rt, "bulk": a.max_queued_ms_bulk}
        q = settings.quota
        self.quotas = TenantQuotas(QuotaLimits(
            rate_per_s=q.rate_per_s, burst=q.burst, overrides=parse_quota_overrides(q.overrides), fair_share=q.fair_share,
            max_queued_ms=q.max_queued_ms, window_ms=float(q.window_ms), max_tenants=q.max_tenants,
            ref_bytes_per_s=q.ref_bytes_per_s,
            ref_bytes_burst=q.ref_bytes_burst or max(q.ref_bytes_per_s, float(settings.limits.max_request_ref_bytes)),
            compute_ms_per_s=compute_rate(settings), compute_burst_ms=q.compute_burst_ms,
            compute_debt=q.compute_debt))
        self.dlq_budget = KeyedBudget(settings.dlq.tenant_rate_per_s, settings.dlq.tenant_burst, q.max_tenants)
        self.nonce = nonce
        self.ref_sizes = ref_sizes
        self.replica = f"router/{os.getpid()}-{secrets.token_hex(3)}"
        """This router process, in the manifests it charges output tokens in: the generators
        give the unused ones back to it (``load_reports.take_gen_credits``), not to another
        replica whose buckets never paid them."""

    async def handle(self, raw: bytes, headers: Any, record_ts_ms: float | None, source: str,
                     tenant: str | None = None) -> Routed:
        """Route one ingress record. ``tenant``: the tenant the broker authenticated (from
        the tenant's own ingress topic), or None where the payload's tenant is believed.

        Routing that raises (a bug) costs this record only: it is dead-lettered (within its
        tenant's DLQ budget) and, where it still says who sent it, they are answered
        ``internal`` instead of waiting out their timeout."""
        try:
            return await self._handle(raw, headers, record_ts_ms, source, tenant)
        except Exception as exc:  # noqa: BLE001 - a bug must cost one record, not the stage
            return await self._failed(raw, headers, record_ts_ms, source, tenant, exc)

    async def _failed(self, raw: bytes, headers: Any, record_ts_ms: float | None, source: str,
                      tenant: str | None, exc: Exception) -> Routed:
        parked = self._dlq(raw, headers, source, f"{ErrorCode.INTERNAL}: router failed: {exc!r}", tenant)
        if parked.outcome == "dlq":  # within the budget: a bug hit by every record must not flood the log
            log.error("router: failed on %s (%s, at %s)", bounded(source), bounded(repr(exc)), raised_at(exc))
        try:
            obj = unpack(raw, header(headers, CONTENT_TYPE_HEADER)) \
                if raw is not None and len(raw) <= self.settings.limits.max_request_bytes else None
        except DecodeError:
            return parked
        who = peek_reply(obj)
        if who is None:
            return parked
        rid, reply_to = who
        try:
            reply_to = await self.replies.check(reply_to, tenant)
        except WireError:
            reply_to = self.replies.default(tenant)
        err = WireError(ErrorCode.INTERNAL, "the router failed on this request (a bug, logged; the record is in the "
                        "dead-letter topic); it was not processed", None)
        event = Event(rid, EventKind.ERROR, 0, now_ms(), error=err.to_wire())
        lane = obj.get("lane") if obj.get("lane") in ("rt", "bulk") else "rt"
        digest = record_digest(raw, record_ts_ms)
        v = self._verdict(rid, tenant if tenant is not None else obj.get("tenant"), lane, reply_to, [event], digest)
        # The answer first, as in every error the router answers (a reused id's refusal reads it there).
        return Routed([v, *parked.outs], "error", str(ErrorCode.INTERNAL), lane=lane,
                      key=v.key.decode() if v.key else None, digest=digest, parked=parked.outcome)

    async def _handle(self, raw: bytes, headers: Any, record_ts_ms: float | None, source: str,
                      tenant: str | None) -> Routed:
        started = now_ms()
        checked = await self._checked(raw, headers, record_ts_ms, source, tenant)
        if isinstance(checked, Routed):
            return checked
        req, digest, ref_bytes, refused, claims = checked
        priced = self._price(req, refused, claims)
        # The client's timestamp, believed only within [started - max age, started].
        client_sent = min(started, max(record_ts_ms, started - self.settings.router.max_record_age_ms)) \
            if record_ts_ms else started
        # The whole-answer lookup is the last await: from the quota to the reservation of
        # what it sends (load.note_sent, quotas.note_sent) nothing yields, so the records of
        # one poll, routed concurrently, cannot all be admitted on the same queued work.
        key = self._result_key(req)
        stored = await self.results.get(key) if key is not None else None
        work = self._work_ms(req, priced)
        shed = self._quota(req, started, sum(ref_bytes.values()), work, _stages(priced), answered=stored is not None)
        if shed is not None:
            return self._shed(req, shed, digest)
        if stored is not None:
            return self._answer_from_cache(req, stored, client_sent, started, digest)
        decision, waits = self._admit(req, priced)
        if isinstance(decision, Reject):
            if decision.code == ErrorCode.OVERLOADED:  # kept out: the others keep to their fair share
                self.quotas.note_refused(req.tenant, started, decision.stage)
            return self._refused(req, WireError(decision.code, decision.message, None, decision.retry_after_ms), digest)
        return self._accepted(req, decision, key, client_sent, started, digest, refused, ref_bytes, priced,
                              self._ref_bounds(req, claims), waits, work)

    async def _checked(self, raw: bytes, headers: Any, record_ts_ms: float | None, source: str,
                       tenant: str | None) -> tuple[Any, str, dict[int, int], dict[int, WireError], dict[int, ClaimSize]] | Routed:
        """A valid request with its record digest and its refs priced (bytes per part, the
        parts refused, size and first bytes per part), or what answers the record instead (an
        error event, its tenant's quota shed where no price could change it, or the DLQ for a
        record no one can be answered for)."""
        content_type = header(headers, CONTENT_TYPE_HEADER)
        if raw is not None and len(raw) > self.settings.limits.max_request_bytes:
            return self._dlq(raw, headers, source, f"{ErrorCode.PAYLOAD_TOO_LARGE}: request is {len(raw)} bytes", tenant)
        try:
            obj = unpack(raw, content_type)
        except DecodeError as exc:
            return self._dlq(raw, headers, source, f"undecodable: {exc}", tenant)
        from_json = (content_type or "").startswith(JSON) or (content_type is None and bytes(raw).lstrip()[:1] == b"{")
        digest = record_digest(raw, record_ts_ms)
        try:
            req = validate_request(obj, self.limits, from_json=from_json, modalities=self.known_modalities)
            if str(req.task) not in self.served_tasks:
                raise WireError(ErrorCode.INVALID_REQUEST,
                                f"task {req.task!s} is not served by this deployment (served: {', '.join(sorted(self.served_tasks))})",
                                "task")
            if tenant is not None:
                given = obj.get("tenant")
                if given is not None and given != tenant:
                    raise WireError(ErrorCode.INVALID_REQUEST,
                                    f"tenant {given!r} is not the tenant this ingress topic belongs to; leave tenant "
                                    "out (it is taken from the topic) or send on that tenant's own topic", "tenant")
                req = dataclasses.replace(req, tenant=tenant)
            req = dataclasses.replace(req, reply_to=await self.replies.check(req.reply_to, tenant))
            early = self._precheck(req)
            if early is not None:
                return self._shed(req, early, digest)
            ref_bytes, refused, claims = await self._price_refs(req)
        except WireError as err:
            who = peek_reply(obj)
            if who is None:
                return self._dlq(raw, headers, source, f"{err.code}: {err.message} (no readable id to answer)", tenant)
            rid, reply_to = who
            try:
                reply_to = await self.replies.check(reply_to, tenant)
            except WireError:
                reply_to = self.replies.default(tenant)
            event = Event(rid, EventKind.ERROR, 0, now_ms(), error=err.to_wire())
            who_tenant = tenant if tenant is not None else obj.get("tenant")
            v = self._verdict(rid, who_tenant, "rt", reply_to, [event], digest)
            return Routed([v], "error", str(err.code), key=v.key.decode() if v.key else None, digest=digest)
        return req, digest, ref_bytes, refused, claims

    def _shed(self, req: Any, shed: Shed, digest: str) -> Routed:
        """``req`` refused by its tenant's quota."""
        err = WireError(ErrorCode.OVERLOADED, shed.message, None, shed.retry_after_ms) \
            if shed.retry_after_ms is not None else WireError(ErrorCode.PAYLOAD_TOO_LARGE, shed.message, "parts")
        return self._refused(req, err, digest, shed=(req.tenant, shed.reason))

    def _refused(self, req: Any, err: WireError, digest: str, shed: tuple[str, str] | None = None) -> Routed:
        # A valid request answered with ``err`` (shed by its quota, or refused by admission).
        event = Event(req.id, EventKind.ERROR, 0, now_ms(), error=err.to_wire())
        return Routed([self._verdict(req.id, req.tenant, str(req.lane), req.reply_to, [event], digest)], "error",
                      str(err.code), lane=str(req.lane), admission="reject", shed=shed,
                      key=request_key(req.tenant, req.id), digest=digest)

    def _accepted(self, req: Any, decision: Admit | None, key: str | None, client_sent: float, started: float,
                  digest: str, refused: dict[int, WireError], ref_bytes: dict[int, int], priced: list[Priced],
                  ref_pixels: dict[int, int], waits: dict[str, float], work_ms: float) -> Routed:
        """An admitted request split into its records: the manifest first (the assembler sends
        ``accepted`` when it arrives), then the parts that failed alone, then the jobs, in
        one producer batch, so encoders start on the parts at once. What it sends is reserved
        in the load view and the tenant's quota before anything yields."""
        costs = {id(p): (found[1] if found is not None else 0.0) for p, found in zip(req.parts, priced)}
        plan = split_request(
            req, topics=self.topics, partitions=self.settings.kafka.partitions, partitioner=self.partitioner,
            result_key=key,
            cost_ms=lambda part: costs[id(part)], modality_topics=self.settings.router.modality_topics,
            served_modalities=self.served_modalities, client_sent_at_ms=client_sent,
            started_at_ms=started, now_ms=now_ms(), default_deadline_ms=self.settings.limits.default_deadline_ms,
            nonce=self.nonce(), digest=digest, refused=refused, ref_bytes=ref_bytes,
            ref_pixels=ref_pixels, prep_ms={i: found.prep_ms for i, found in enumerate(priced)
                                            if found is not None and found.prep_ms > 0},
            predicted_wait_ms=lambda topic: waits.get(stage_of(topic)),
            # A request priced over its tenant's whole bucket runs below everyone else's work.
            background=self.quotas.over_bucket(work_ms),
            # What its output was charged: the generator gives back the tokens it does not make.
            charged_tokens=int(req.params.max_tokens) if str(req.task) == "generate" and self.quotas.charges_compute
            else None,
            charged_by=self.replica,
        )
        m = plan.manifest
        encoded = self.topics.encoded(req.lane)
        rkey = request_key(req.tenant, req.id)
        outs = [out_map(encoded, rkey, m.to_wire())]
        outs += [out_map(encoded, rkey, p.to_wire()) for p in plan.failed_parts]
        jobs = tuple(JobOut(j, out_map(j.topic, j.key, j.job.to_wire(), j.partition), costs[id(req.parts[j.job.part])])
                     for j in plan.jobs)
        outs += [j.out for j in jobs]
        for j in jobs:
            self.load.note_sent(j.job.topic, j.job.partition, j.cost_ms, m.accepted_at_ms, req.tenant)
        wait = decision.predicted_wait_ms if isinstance(decision, Admit) else 0.0
        self.quotas.note_sent(req.tenant, work_ms, started, wait)
        modalities = set(m.modalities)
        return Routed(outs, "ok", modality=modalities.pop() if len(modalities) == 1 else "mixed", lane=str(req.lane),
                      queued_ms=max(0.0, started - client_sent), service_ms=m.accepted_at_ms - started,
                      admission="admit" if decision is not None else None, jobs=jobs, key=rkey, digest=digest,
                      manifest=m)

    def _result_key(self, req: Any) -> str | None:
        """The whole-result key of an embed request whose parts all have content here and a
        published model, at most ``cache.whole_result_max_bytes`` of it; None when it cannot
        be cached (a bigger request is rarely sent twice, and hashing it would cost the
        router for every copy a flood sends, shed or not)."""
        if not self._cacheable(req):
            return None
        parts = []
        for p in req.parts:
            content = normalize(p.text).encode() if p.text is not None else p.data
            parts.append((str(p.modality), content_digest(content or b"")))
        tenant = None if self.settings.cache.cross_tenant else req.tenant
        return result_key(tenant=tenant, task="embed", parts=parts, models=self.models)

    def _cacheable(self, req: Any) -> bool:
        """Whether the whole-result cache may hold ``req``'s answer (``_result_key``)."""
        if self.results is None or str(req.task) != "embed" or not self.settings.cache.whole_result:
            return False
        size = sum(len(p.text) if p.text is not None else len(p.data or b"") for p in req.parts)
        return size <= self.settings.cache.whole_result_max_bytes and all(
            str(p.modality) in self.served_modalities and p.ref is None for p in req.parts)

    def _precheck(self, req: Any) -> Shed | None:
        """The tenant's quota shed that no price of ``req`` can change (``TenantQuotas.precheck``)."""
        if not self.quotas.enabled:
            return None
        return self.quotas.precheck(req.tenant, now_ms=now_ms(), has_refs=any(p.ref is not None for p in req.parts),
                                    costs_work=not self._cacheable(req))

    def _answer_from_cache(self, req: Any, payload: dict[str, Any], client_sent: float, started: float,
                           digest: str) -> Routed:
        now = now_ms()
        reply_to = req.reply_to or self.topics.results
        span = {"stage": "route", "queued_ms": round(max(0.0, started - client_sent), 3),
                "service_ms": round(now - started, 3)}
        accepted = Event(req.id, EventKind.ACCEPTED, 0, now, payload={"task": "embed", "parts": len(req.parts)})
        result = Event(req.id, EventKind.RESULT, 1, now, payload=payload,
                       timings={"e2e_ms": round(now - client_sent, 3), "stages": [span], "parts": []},
                       cache={"hits": len(req.parts), "misses": 0, "result": "hit"})
        modalities = {str(p.modality) for p in req.parts}
        return Routed([self._verdict(req.id, req.tenant, str(req.lane), reply_to, [accepted, result], digest)],
                      "ok", modality=modalities.pop() if len(modalities) == 1 else "mixed", lane=str(req.lane),
                      queued_ms=span["queued_ms"], service_ms=span["service_ms"], admission="admit",
                      key=request_key(req.tenant, req.id), digest=digest)

    def _price(self, req: Any, refused: dict[int, WireError], claims: dict[int, ClaimSize]) -> list[Priced]:
        """Each part's price, None for a part that makes no job: its ref refused, a generate
        request's text (the language model reads it; no encoder does), a modality not served."""
        generate = str(req.task) == "generate"
        return [None if i in refused or (generate and str(p.modality) == "text") else self._part_stage(p, claims.get(i))
                for i, p in enumerate(req.parts)]

    def _part_stage(self, part: Any, claim: ClaimSize | None = None) -> Priced:
        """(the encode stage whose engine a part loads, its predicted ms there); None for a
        modality not served here. A video's frames load the image pool. ``claim``: the size
        and first bytes of what the part's ref names (inline data is read itself)."""
        spec = modalities.get(str(part.modality))
        if spec is None or spec.name not in self.served_modalities:
            return None
        stage = spec.admission_stage
        size = len(part.text) if part.text is not None else len(part.data or b"")
        units = spec.units(size, self.settings.video.max_frames)
        if spec.head_units is not None and part.text is None:  # what its header allows (an audio clip's windows)
            units = spec.head_units(*self._head(part, size, claim), self.settings.limits)
        if spec.cost_unit == "token":  # cost depends on the length: ask for that length
            tokens = min(TEXT_MAX_TOKENS, units)
            reported = self.load.item_ms(stage, tokens)
            return Price(stage, reported if reported is not None else spec.ms_per_unit * tokens)
        reported = self.load.item_ms(stage, 1)
        ms, prep = units * (reported if reported is not None else spec.ms_per_unit), 0.0
        if spec.prepare_ms is not None and part.text is None:
            prep = spec.prepare_ms(*self._head(part, size, claim), self.settings.limits.max_image_pixels)
        return Price(stage, ms + prep, prep, self._fanned_out(spec, part, size, claim))

    def _fanned_out(self, spec: Any, part: Any, size: int, claim: ClaimSize | None) -> tuple[tuple[str, float], ...]:
        """What a part costs the pools it fans out to beyond its admission stage (served ones)."""
        if spec.fanout_units is None or part.text is not None:
            return ()
        out = []
        for name, units in spec.fanout_units(self._head(part, size, claim)[0], self.settings).items():
            other = modalities.get(name)
            if other is None or name not in self.served_modalities or units <= 0:
                continue
            reported = self.load.item_ms(other.stage, 1)
            out.append((other.stage, units * (reported if reported is not None else other.ms_per_unit)))
        return tuple(out)

    def _head(self, part: Any, size: int, claim: ClaimSize | None) -> tuple[bytes, int]:
        """(the first bytes, the size) a part's header price reads: inline data whole (the
        header parse reads no further than the header); a ref the sizer did not read is
        priced at the bounds."""
        if part.data is not None:
            return part.data, size
        return (claim.head, claim.size) if claim else (b"", self.settings.limits.max_ref_bytes)

    def give_back(self, tokens: dict[str, int], now: float) -> None:
        """Return to each tenant's compute bucket the output tokens it was charged for and the
        generators did not make (tenant -> tokens), at the current price of a token (the step
        cost may have moved since they were charged: a refund is an estimate, never past full)."""
        each = token_price_ms(self.gen_cost, self.settings.quota.generation_shared_by)
        for tenant, n in tokens.items():
            self.quotas.refund(tenant, n * each, now)

    def _generate_cost(self, req: Any) -> float:
        """The generator's work a generate request causes (0 for embed), priced before any
        of it runs, so a tenant's quota counts generation too: CPU ms, at the generators'
        measured step cost, as if it ran alone (``streams.policies.gen_price``)."""
        if str(req.task) != "generate":
            return 0.0
        chars = sum(len(p.text) for p in req.parts if p.text is not None)
        others = sum(1 for p in req.parts if p.text is None)
        return price_generate_ms(estimate_prompt_tokens(chars, others), int(req.params.max_tokens), self.gen_cost,
                                 self.settings.quota.generation_shared_by)

    def _ref_bounds(self, req: Any, claims: dict[int, ClaimSize]) -> dict[int, int]:
        """Per ref part whose modality bounds it (an image): what its job may not exceed
        (``EncodeJob.ref_pixels``), read from the head priced at admission."""
        out: dict[int, int] = {}
        for i, claim in claims.items():
            bound = getattr(modalities.get(str(req.parts[i].modality)), "ref_bound", None)
            found = bound(claim.head) if bound is not None and claim.head else None
            if found is not None:
                out[i] = found
        return out

    def _wants_head(self, req: Any) -> frozenset[int]:
        """The ref parts whose price needs their first bytes (an image's or a clip's header)."""
        return frozenset(i for i, p in enumerate(req.parts) if p.ref is not None and any(
            getattr(modalities.get(str(p.modality)), hook, None) is not None
            for hook in ("prepare_ms", "head_units", "fanout_units")))

    async def _price_refs(self, req: Any) -> tuple[dict[int, int], dict[int, WireError], dict[int, ClaimSize]]:
        """(part index -> stored bytes of its ref, part index -> the error it fails with, part
        index -> what the sizer read of its ref) for the ref parts of a served modality. Raises ``WireError`` (``payload_too_large``) when
        the refs that resolve name more than ``limits.max_request_ref_bytes`` together."""
        refs = [(i, p.ref) for i, p in enumerate(req.parts)
                if p.ref is not None and str(p.modality) in self.served_modalities]
        if not refs:
            return {}, {}, {}
        lim = self.settings.limits
        if self.ref_sizes is None:
            found: dict[int, ClaimSize | WireError] = {i: ClaimSize(lim.max_ref_bytes) for i, _ in refs}
        else:
            found = await self.ref_sizes(refs, req.tenant, self._wants_head(req))
        sizes: dict[int, int] = {}
        claims: dict[int, ClaimSize] = {}
        refused: dict[int, WireError] = {}
        for i, _ in refs:
            got = found.get(i, WireError(ErrorCode.INTERNAL, "the claim check could not be sized", f"parts.{i}.ref"))
            if isinstance(got, WireError):
                refused[i] = got
            elif got.size > lim.max_ref_bytes:
                refused[i] = WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"the referenced payload is {got.size} bytes; the "
                                       f"limit is {lim.max_ref_bytes}", f"parts.{i}.ref")
            else:
                sizes[i], claims[i] = got.size, got
        total = sum(sizes.values())
        if total > lim.max_request_ref_bytes:
            raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"the refs of this request name {total} bytes together; the "
                            f"limit is {lim.max_request_ref_bytes} per request", "parts")
        return sizes, refused, claims

    def _work_ms(self, req: Any, priced: list[Priced]) -> float:
        """All the work a request is priced at (ms): each part's at its stage and at the pools
        it fans out to, and a generation's."""
        return sum(found.ms + sum(ms for _, ms in found.also) for found in priced if found is not None) \
            + self._generate_cost(req)

    def _quota(self, req: Any, now: float, ref_bytes: int, work_ms: float, stages: set[str],
               answered: bool = False) -> Shed | None:
        """The tenant's quota decision (None: within it, or no quota is set). ``stages``: those
        the request needs; ``answered``: the reuse cache holds the whole answer, so the request
        costs no engine work: only its rate token is taken (a tenant in compute debt still gets
        what it already paid for)."""
        if not self.quotas.enabled:
            return None
        if answered:
            return self.quotas.check_rate(req.tenant, now_ms=now)
        return self.quotas.check(req.tenant, lane_limit_ms=self.lane_limit_ms.get(str(req.lane), 0.0), now_ms=now,
                                 ref_bytes=ref_bytes, cost_ms=work_ms, stages=stages)

    def _admit(self, req: Any, priced: list[Priced]) -> tuple[Admit | Reject | None, dict[str, float]]:
        """The admission decision for a valid request (None when admission is off), and the
        wait predicted at each stage it needs before calibration (what its jobs carry)."""
        if self.admission is None:
            return None, {}
        stages: dict[str, float] = {}
        for found in priced:
            if found is None:
                continue
            stages[found.stage] = stages.get(found.stage, 0.0) + found.ms
            for stage, ms in found.also:
                stages[stage] = stages.get(stage, 0.0) + ms
        deadline = req.deadline_ms or self.settings.limits.default_deadline_ms
        lane = str(req.lane)
        predicted = self.load.queued_ms(lane, tenant=req.tenant, own_ms=stages, only=stages, now_ms=now_ms())
        # Corrected by what rt jobs waited (rt is what teaches it); a stage the model sees as
        # idle stays idle, so a costly request still gets onto it (admission's IDLE_SHARE).
        idle = IDLE_SHARE * self.lane_limit_ms.get(lane, 0.0)
        queued = predicted if lane != "rt" else \
            {s: self.load.calibrated(s, ms) if ms > idle else ms for s, ms in predicted.items()}
        return admit(lane=lane, stages=stages, queued_ms=queued, deadline_ms=deadline,
                     limits=self.admission), predicted

    def _verdict(self, rid: str, tenant: Any, lane: str, reply_to: str | None, events: list[Event],
                 digest: str | None) -> Out:
        """The router's own answer, sent through the assembler (which sends each client
        event exactly once), on the lane's encoded topic keyed like the request's parts. An
        unreadable tenant (of a request that failed validation) is answered as ``default``."""
        if not (isinstance(tenant, str) and len(tenant) <= self.limits.max_tenant_chars and TENANT_RE.fullmatch(tenant)):
            tenant = "default"
        v = Verdict(id=rid, tenant=tenant, lane=lane, reply_to=reply_to or self.topics.results,
                    events=[e.to_wire() for e in events], sent_at_ms=now_ms(), digest=digest)
        return out_map(self.topics.encoded(lane if lane in ("rt", "bulk") else "rt"), request_key(tenant, rid),
                       v.to_wire())

    def _dlq(self, raw: bytes, headers: Any, source: str, reason: str, tenant: str | None) -> Routed:
        """Park a record no one can be answered for, within its tenant's DLQ budget (every
        plaintext client is one tenant here: its tenant field is unreadable); past it the
        record is only counted, so a flood of garbage costs neither the DLQ nor the log."""
        if not self.dlq_budget.take(tenant or "", now_ms()):
            return Routed([], "dlq_dropped")
        log.warning("router: to DLQ from %s: %s", bounded(source), bounded(reason))
        return Routed([dead_letter(self.topics.dlq, None, raw, reason, headers=headers, source=source,
                                   max_bytes=self.settings.kafka.max_message_bytes,
                                   keep_payload=self.settings.dlq.keep_payload)], "dlq")


SECURE_COMPUTE_MS_PER_S = 500.0
"""A tenant's compute quota where tenants are authenticated and none is set: a quarter of a
2-core box's engine time per router replica, about 2.5x what 20 requests per second of
ordinary text embeds are priced at (docs/isolation.md)."""


def _stages(priced: list[Priced]) -> set[str]:
    """The stages a request's priced parts need: each part's own and those it fans out to."""
    return {stage for found in priced if found is not None for stage in (found.stage, *(s for s, _ in found.also))}


def compute_rate(settings: Settings) -> float:
    """The per-tenant compute quota in effect (``quota.compute_ms_per_s``; -1 picks by mode)."""
    rate = settings.quota.compute_ms_per_s
    if rate >= 0:
        return rate
    return SECURE_COMPUTE_MS_PER_S if settings.kafka.authenticated else 0.0


def record_digest(raw: bytes, record_ts_ms: float | None) -> str:
    """Which ingress record this is: its bytes and its timestamp (the producer's, kept by a
    retry of the same batch), hashed. The same request sent again is another record."""
    h = hashlib.sha256(repr(record_ts_ms).encode())
    h.update(b"\0")
    h.update(bytes(raw))
    return h.hexdigest()[:32]
