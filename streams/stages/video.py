"""The video stage: one video part in, a header for the assembler and frame-chunk jobs for
the image pool out (see workers/video.py). Decoding runs in a thread, off the event loop.

What one clip may cost here is bounded: at most ``video.max_decoded_pixels`` decoded (every
frame, sampled or not), and nothing past its deadline: a job already expired is answered
``deadline_exceeded`` without a byte decoded, and a decode that runs past the deadline stops
at the next frame. The one decode thread takes held jobs rt first and, within a lane, one
tenant at a time in turn (``streams.policies.fair_queue``), so a tenant's burst of clips
waits behind its own, not in front of everyone's."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faust

from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob, request_key
from schemas.settings import Settings
from schemas.trace import Span, now_ms
from streams.app import topic_names
from streams.observe.metrics import Metrics
from streams.policies.fair_queue import FairQueue
from streams.runtime.produce import Out, out_map
from streams.runtime.stage import RecordStage
from streams.policies.split import spread_partitions
from workers import modalities
from workers.encoders import claim_resolver
from workers.audio_header import SLACK_S
from workers.video import FRAMES_MIME, chunk_frames, decode_video, extract_audio_wav
from workers.video_header import soundtrack_seconds

log = logging.getLogger(__name__)
STAGE = "encode.video"


def plan_fanout(job: EncodeJob, settings: Settings, decode: Any = decode_video, resolver: Any = None) -> list[Out]:
    """The records for one video job: a failed part, or a header plus one job per chunk."""
    names = topic_names(settings)
    started = now_ms()
    v = settings.video
    try:
        if job.deadline_at_ms <= started:
            raise WireError(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the video was decoded",
                            f"parts.{job.part}")
        data = job.data
        if data is None:
            if resolver is None:
                raise WireError(ErrorCode.INVALID_REQUEST, "the part has no bytes")
            data = resolver.fetch(job.ref or "", f"parts.{job.part}.ref", job.tenant, job.ref_bytes)
        video = decode(data, v.max_seconds, v.max_frames, v.fps, max_pixels=settings.limits.max_image_pixels,
                       max_decoded_pixels=v.max_decoded_pixels, expired=lambda: now_ms() >= job.deadline_at_ms)
    except WireError as err:
        span = Span(STAGE, job.sent_at_ms, started, now_ms()).to_wire()
        field = err.field or f"parts.{job.part}"
        failed = EncodedPart(id=job.id, part=job.part, modality="video", sent_at_ms=now_ms(), trace=[span],
                             error=WireError(err.code, err.message, field, err.retry_after_ms).to_wire(),
                             tenant=job.tenant, nonce=job.nonce)
        return [out_map(names.encoded(job.lane), request_key(job.tenant, job.id), failed.to_wire())]
    chunks = chunk_frames(video.frames, v.frames_per_chunk)
    extras: dict[str, Any] = {"duration_s": round(video.duration_s, 3), "frames_sampled": len(video.frames),
                              "has_audio": video.has_audio, "fps": v.fps}
    audio: bytes | None = None
    if video.has_audio and "audio" in modalities.served(settings):
        # No more of it than the router priced at the audio pool, read from the same bytes.
        priced = soundtrack_seconds(data, min(v.max_seconds, settings.limits.max_audio_seconds))
        try:
            if priced <= 0:
                raise WireError(ErrorCode.UNSUPPORTED_MEDIA, "the container's index declares no sound track: "
                                "its audio was not priced, and is not transcribed")
            audio = extract_audio_wav(data, min(v.max_seconds, priced + SLACK_S))
        except WireError as err:
            extras["audio_error"] = err.to_wire()
    elif video.has_audio:
        extras["audio_error"] = WireError(ErrorCode.UNSUPPORTED_MEDIA, "no audio encoder is deployed here").to_wire()
    span = Span(STAGE, job.sent_at_ms, started, now_ms()).to_wire()
    sent = now_ms()
    header = EncodedPart(id=job.id, part=job.part, modality="video", sent_at_ms=sent,
                         n_chunks=len(chunks) + (audio is not None), extras=extras, trace=[span],
                         tenant=job.tenant, nonce=job.nonce)
    outs = [out_map(names.encoded(job.lane), request_key(job.tenant, job.id), header.to_wire())]
    spread = spread_partitions(f"{job.id}:{job.part}", len(chunks), settings.kafka.partitions)
    for k, data in enumerate(chunks):
        chunk_job = EncodeJob(id=job.id, part=job.part, n_parts=job.n_parts, modality="image", lane=job.lane,
                              tenant=job.tenant, deadline_at_ms=job.deadline_at_ms, sent_at_ms=sent, data=data,
                              mime=FRAMES_MIME, trace=[span], chunk=k, nonce=job.nonce, background=job.background)
        topic = names.encode("image", job.lane)
        outs.append(out_map(topic, f"{job.id}:{job.part}:{k}", chunk_job.to_wire(), spread[k]))
    if audio is not None:  # the soundtrack goes to the audio pool as the last chunk
        k = len(chunks)
        track = EncodeJob(id=job.id, part=job.part, n_parts=job.n_parts, modality="audio", lane=job.lane,
                          tenant=job.tenant, deadline_at_ms=job.deadline_at_ms, sent_at_ms=sent, data=audio,
                          mime="audio/wav", trace=[span], chunk=k, nonce=job.nonce, background=job.background)
        outs.append(out_map(names.encode("audio", job.lane), f"{job.id}:{job.part}:{k}", track.to_wire()))
    return outs


class VideoStage(RecordStage):
    """Video jobs in, fan-out records out. Decoding runs in one thread, one video at a time,
    while the record loop keeps fetching; each job record is finished once its fan-out is
    with the broker. Intake is bounded: at most ``video.max_held`` jobs are held (each with
    its bytes); at the bound the runtime pauses the stage's topics until one is done. The
    thread takes the held jobs in the fair queue's order (rt first, tenants in turn)."""

    stage = STAGE

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics) -> None:
        names = topic_names(settings)
        super().__init__(app, settings, [names.encode("video", "rt")], [names.encode("video", "bulk")],
                         rt_backlog_records=max(1, settings.admission.rt_backlog_records // 10))
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="video-decode")
        self.resolver = claim_resolver(settings)
        self.held = 0
        self.max_held = settings.video.max_held
        self.waiting: FairQueue[tuple[EncodeJob, ConsumerRecord]] = FairQueue()
        self._decoding = False

    def poll_budget(self) -> int:
        return max(0, self.max_held - self.held)  # at 0 the runtime pauses the stage's topics

    async def handle(self, records: list[ConsumerRecord]) -> None:
        for r in records:
            try:
                job = EncodeJob.from_wire(unpack(r.value))
            except (DecodeError, ValueError, TypeError, RecursionError) as exc:
                self.metrics.to_dlq(STAGE)
                self.io.deliver([self.dlq(r, f"invalid_request: undecodable encode job: {exc}")], [r])
                continue
            self.held += 1
            self.waiting.push(job.lane, job.tenant, (job, r))
            self.io.hold([r])
        if not self._decoding and len(self.waiting):
            self._decoding = True
            asyncio.ensure_future(self._decode_waiting())

    async def _decode_waiting(self) -> None:
        """Decode the held jobs one at a time, in the fair queue's order, until none is left."""
        try:
            while len(self.waiting):
                job, record = self.waiting.pop()
                await self._fan_out(job, record)
        finally:
            self._decoding = False

    async def _fan_out(self, job: EncodeJob, record: ConsumerRecord) -> None:
        try:
            outs = await asyncio.get_running_loop().run_in_executor(
                self.executor, plan_fanout, job, self.settings, decode_video, self.resolver)
        except Exception as exc:  # a bug must cost this part, not the stage
            log.exception("%s: failed on %s part %d", STAGE, job.id, job.part)
            err = WireError(ErrorCode.INTERNAL, f"video stage failed: {exc!r}", f"parts.{job.part}")
            outs = [out_map(self.names.encoded(job.lane), request_key(job.tenant, job.id), EncodedPart(
                id=job.id, part=job.part, modality="video", sent_at_ms=now_ms(), error=err.to_wire(),
                tenant=job.tenant, nonce=job.nonce).to_wire())]
        finally:
            self.held -= 1
        self.io.deliver(outs, [record])
        self.metrics.request_done(STAGE, "ok" if len(outs) > 1 else "error")


def install_video_fanout(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    VideoStage(app, settings, metrics).install()
