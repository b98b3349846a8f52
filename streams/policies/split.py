"""The router's decision for one valid request, as plain data: the manifest for the
assembler, one encode job per part, and the parts that fail right away (a modality no
pool serves here). Pure: the router stage produces what this returns."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Mapping

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob, Manifest
from schemas.request import Modality, Part, Request, Task
from schemas.trace import Span
from streams.policies.partitioning import Partitioner
from schemas.topics import ANY, TopicNames


@dataclass(frozen=True, slots=True)
class RoutedJob:
    topic: str
    key: bytes
    job: EncodeJob
    partition: int | None


@dataclass(frozen=True, slots=True)
class RoutePlan:
    manifest: Manifest
    jobs: list[RoutedJob]
    failed_parts: list[EncodedPart]
    """Parts answered by the router itself (sent to the assembler like encoder output): an
    unserved modality's error, or a generate request's text, which needs no encoding."""


def spread_partitions(request_id: str, n_parts: int, partitions: int) -> list[int]:
    """Consecutive partitions from a stable start per request, so the parts of one request
    land on different partitions (and so on different replicas) and encode in parallel,
    while different requests start at different places."""
    start = zlib.crc32(request_id.encode()) % partitions
    return [(start + i) % partitions for i in range(n_parts)]


def split_request(
    req: Request,
    *,
    topics: TopicNames,
    partitions: int,
    partitioner: Partitioner | None = None,
    cost_ms: Callable[[Part], float] = lambda part: 1.0,
    modality_topics: bool = True,
    result_key: str | None = None,
    served_modalities: frozenset[str],
    client_sent_at_ms: float,
    started_at_ms: float,
    now_ms: float,
    default_deadline_ms: int,
    nonce: str | None = None,
    digest: str | None = None,
    refused: Mapping[int, WireError] | None = None,
    ref_bytes: Mapping[int, int] | None = None,
    ref_pixels: Mapping[int, int] | None = None,
    prep_ms: Mapping[int, float] | None = None,
    predicted_wait_ms: Callable[[str], float | None] = lambda topic: None,
    background: bool = False,
    charged_tokens: int | None = None,
    charged_by: str | None = None,
) -> RoutePlan:
    """Split ``req`` into per-part encode jobs on each modality's topic for the request's lane.

    ``client_sent_at_ms`` is the ingress record's timestamp; the router's span runs from it
    (queued) through ``started_at_ms`` to ``now_ms``. ``nonce`` goes into the manifest, every
    job and every part answered here (``schemas.jobs``: how the assembler knows its parts);
    ``digest`` names the ingress record in the manifest. ``refused``: parts that fail here with
    that error (a ref the router could not price); ``ref_bytes``: the priced size of each ref
    part, carried in its job; ``ref_pixels``: the pixels an image ref's header declared, too;
    ``prep_ms``: what a part's work before the engine was priced at (``EncodeJob.prep_ms``);
    ``predicted_wait_ms``: the wait admission predicted on a job's topic, to which each job adds
    the cost of the request's parts before it there (``EncodeJob.predicted_wait_ms``);
    ``background``: a request admitted in debt (``Manifest.background``, and each job's); ``charged_tokens``:
    the output tokens its tenant's quota charged it for (``Manifest.charged_tokens``), at the
    router replica ``charged_by``.
    """
    refused = refused or {}
    ref_bytes = ref_bytes or {}
    ref_pixels = ref_pixels or {}
    deadline_at = now_ms + (req.deadline_ms or default_deadline_ms)
    reply_to = req.reply_to or topics.results
    router_span = Span("route", client_sent_at_ms, started_at_ms, now_ms).to_wire()
    manifest = Manifest(
        id=req.id, task=str(req.task), tenant=req.tenant, lane=str(req.lane), reply_to=reply_to,
        n_parts=len(req.parts), modalities=[str(p.modality) for p in req.parts], deadline_at_ms=deadline_at,
        accepted_at_ms=now_ms, client_sent_at_ms=client_sent_at_ms, sent_at_ms=now_ms,
        params=req.params.to_wire(), trace=[router_span], result_key=result_key, nonce=nonce, digest=digest,
        background=True if background else None, charged_tokens=charged_tokens,
        charged_by=charged_by if charged_tokens else None,
    )
    jobs: list[RoutedJob] = []
    ahead: dict[str, float] = {}  # topic -> the cost of this request's jobs on it so far
    failed: list[EncodedPart] = []
    partitioner = partitioner or Partitioner("spread")

    def topic_of(part: Part) -> str:
        return topics.encode(part.modality if modality_topics else ANY, req.lane)

    by_topic: dict[str, list[int]] = {}
    for i, part in enumerate(req.parts):
        if i in refused:
            continue
        if str(part.modality) in served_modalities and not (req.task == Task.GENERATE and part.modality == Modality.TEXT):
            by_topic.setdefault(topic_of(part), []).append(i)
    chosen: dict[int, int | None] = {}
    for topic, idx in by_topic.items():
        for i, p in zip(idx, partitioner.pick(topic, partitions, req.id, [cost_ms(req.parts[i]) for i in idx])):
            chosen[i] = p
    for i, part in enumerate(req.parts):
        modality = str(part.modality)
        if req.task == Task.GENERATE and part.modality == Modality.TEXT:
            # The language model reads text as it is: nothing to encode.
            failed.append(EncodedPart(id=req.id, part=i, modality=modality, sent_at_ms=now_ms,
                                      extras={"text": part.text}, tenant=req.tenant, nonce=nonce))
            continue
        if modality not in served_modalities:
            err = WireError(ErrorCode.UNSUPPORTED_MEDIA,
                            f"no {modality} encoder is deployed here (served: {', '.join(sorted(served_modalities))})",
                            f"parts.{i}.modality")
            failed.append(EncodedPart(id=req.id, part=i, modality=modality, sent_at_ms=now_ms, error=err.to_wire(),
                                      tenant=req.tenant, nonce=nonce))
            continue
        if i in refused:
            failed.append(EncodedPart(id=req.id, part=i, modality=modality, sent_at_ms=now_ms,
                                      error=refused[i].to_wire(), tenant=req.tenant, nonce=nonce))
            continue
        job = EncodeJob(
            id=req.id, part=i, n_parts=len(req.parts), modality=modality, lane=str(req.lane), tenant=req.tenant,
            deadline_at_ms=deadline_at, sent_at_ms=now_ms, text=part.text, data=part.data, ref=part.ref,
            mime=part.mime, nonce=nonce, ref_bytes=ref_bytes.get(i) if part.ref is not None else None,
            ref_pixels=ref_pixels.get(i) if part.ref is not None else None,
            prep_ms=round(prep_ms[i], 1) if prep_ms and i in prep_ms else None,
            predicted_wait_ms=_rounded(_plus(predicted_wait_ms(topic_of(part)), ahead.get(topic_of(part), 0.0))),
            background=True if background else None,
        )
        jobs.append(RoutedJob(topic_of(part), f"{req.id}:{i}".encode(), job, chosen[i]))
        ahead[topic_of(part)] = ahead.get(topic_of(part), 0.0) + cost_ms(part)
    return RoutePlan(manifest, jobs, failed)


def _plus(ms: float | None, more: float) -> float | None:
    return None if ms is None else ms + more


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 1)
