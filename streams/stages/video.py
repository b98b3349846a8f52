"""The video stage: one video part in, a header for the assembler and frame-chunk jobs for
the image pool out (see workers/video.py). Decoding runs in a thread, off the event loop."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faust

from schemas.codec import ERROR_HEADER, DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob
from schemas.settings import Settings
from schemas.trace import Span, now_ms
from streams.app import raw_topic, topic_names
from streams.lanes import install_lane_priority
from streams.metrics import Metrics
from streams.produce import Out, out_map, send_all
from streams.split import spread_partitions
from streams.topics import LANES
from workers import modalities
from workers.encoders import claim_resolver
from workers.video import FRAMES_MIME, chunk_frames, decode_video, extract_audio_wav

log = logging.getLogger(__name__)
STAGE = "encode.video"


def plan_fanout(job: EncodeJob, settings: Settings, decode: Any = decode_video, resolver: Any = None) -> list[Out]:
    """The records for one video job: a failed part, or a header plus one job per chunk."""
    names = topic_names(settings)
    started = now_ms()
    v = settings.video
    try:
        data = job.data
        if data is None:
            if resolver is None:
                raise WireError(ErrorCode.INVALID_REQUEST, "the part has no bytes")
            data = resolver.fetch(job.ref or "", f"parts.{job.part}.ref")
        video = decode(data, v.max_seconds, v.max_frames, v.fps)
    except WireError as err:
        span = Span(STAGE, job.sent_at_ms, started, now_ms()).to_wire()
        field = err.field or f"parts.{job.part}"
        failed = EncodedPart(id=job.id, part=job.part, modality="video", sent_at_ms=now_ms(), trace=[span],
                             error=WireError(err.code, err.message, field, err.retry_after_ms).to_wire())
        return [out_map(names.encoded(job.lane), job.id, failed.to_wire())]
    chunks = chunk_frames(video.frames, v.frames_per_chunk)
    extras: dict[str, Any] = {"duration_s": round(video.duration_s, 3), "frames_sampled": len(video.frames),
                              "has_audio": video.has_audio, "fps": v.fps}
    audio: bytes | None = None
    if video.has_audio and "audio" in modalities.served(settings):
        try:
            audio = extract_audio_wav(data, v.max_seconds)
        except WireError as err:
            extras["audio_error"] = err.to_wire()
    elif video.has_audio:
        extras["audio_error"] = WireError(ErrorCode.UNSUPPORTED_MEDIA, "no audio encoder is deployed here").to_wire()
    span = Span(STAGE, job.sent_at_ms, started, now_ms()).to_wire()
    sent = now_ms()
    header = EncodedPart(id=job.id, part=job.part, modality="video", sent_at_ms=sent,
                         n_chunks=len(chunks) + (audio is not None), extras=extras, trace=[span])
    outs = [out_map(names.encoded(job.lane), job.id, header.to_wire())]
    spread = spread_partitions(f"{job.id}:{job.part}", len(chunks), settings.kafka.partitions)
    for k, data in enumerate(chunks):
        chunk_job = EncodeJob(id=job.id, part=job.part, n_parts=job.n_parts, modality="image", lane=job.lane,
                              tenant=job.tenant, deadline_at_ms=job.deadline_at_ms, sent_at_ms=sent, data=data,
                              mime=FRAMES_MIME, trace=[span], chunk=k)
        topic = names.encode("image", job.lane)
        outs.append(out_map(topic, f"{job.id}:{job.part}:{k}", chunk_job.to_wire(), spread[k]))
    if audio is not None:  # the soundtrack goes to the audio pool as the last chunk
        k = len(chunks)
        track = EncodeJob(id=job.id, part=job.part, n_parts=job.n_parts, modality="audio", lane=job.lane,
                          tenant=job.tenant, deadline_at_ms=job.deadline_at_ms, sent_at_ms=sent, data=audio,
                          mime="audio/wav", trace=[span], chunk=k)
        outs.append(out_map(names.encode("audio", job.lane), f"{job.id}:{job.part}:{k}", track.to_wire()))
    return outs


def install_video_fanout(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    names = topic_names(settings)

    executor = ThreadPoolExecutor(1, thread_name_prefix="video-decode")
    resolver = claim_resolver(settings)
    source = raw_topic(app, *(names.encode("video", lane) for lane in LANES))
    install_lane_priority(app, settings.kafka.bootstrap, settings.kafka.topic_prefix, names.encode("video", "rt"),
                          names.encode("video", "bulk"), max(1, settings.admission.rt_backlog_records // 10))

    @app.agent(source, name="fanout-video")
    async def fanout(stream: Any) -> None:
        async for event in stream.events():
            try:
                job = EncodeJob.from_wire(unpack(event.value))
            except (DecodeError, ValueError) as exc:
                metrics.to_dlq(STAGE)
                await send_all(app.producer, [Out(names.dlq, event.key, bytes(event.value or b""),
                                                  [(ERROR_HEADER, f"undecodable encode job: {exc}".encode()[:1000])])])
                continue
            try:
                outs = await asyncio.get_running_loop().run_in_executor(
                    executor, plan_fanout, job, settings, decode_video, resolver)
            except Exception as exc:  # a bug must cost this part, not the stage
                log.exception("%s: failed on %s part %d", STAGE, job.id, job.part)
                err = WireError(ErrorCode.INTERNAL, f"video stage failed: {exc!r}", f"parts.{job.part}")
                outs = [out_map(names.encoded(job.lane), job.id, EncodedPart(
                    id=job.id, part=job.part, modality="video", sent_at_ms=now_ms(), error=err.to_wire()).to_wire())]
            await send_all(app.producer, outs)
            metrics.request_done(STAGE, "ok" if len(outs) > 1 else "error")
