"""The batch functions of the encode stages, built from the model repository: one per
modality (behind the reuse cache), plus the generic one of the no-routing baseline.

Each builder returns a ``Runner``: the function the engine thread calls with a batch of
jobs (one output or exception per job) and the cost of one job for the batcher.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import audio, engines, image, text
from workers.audio import AudioEncoder, normalized_speech
from workers.breaker import CircuitBreaker
from workers.cache import CachingBatch, EncoderCache
from workers.cache_keys import cache_key, content_digest
from workers.claims import ClaimResolver
from workers.engines import EngineOptions
from workers.image import ImageEncoder, _warmup_image, load_labels, normalized_pixels
from workers.outputs import Encoded, Observer
from workers.repository import ModelRepository
from workers.text import _WARMUP_TEXTS, TextEncoder, TextPreprocessor, normalize
from workers.video import FRAME_BYTES, FRAMES_MIME, decode_video, frames_from_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runner:
    run_batch: Callable[[list[EncodeJob]], list[Any]]
    cost: Callable[[EncodeJob], float]
    calibrate: Callable[[], tuple[float, float]] | None = None
    identity: str = ""
    """name/version/precision/preprocessing: what the whole-result cache keys on."""
    """Times one representative batch on the engine itself (no cache): (units, ms). The
    router's cost model starts from it before any real traffic has been observed."""


def _timed(fn: Callable[[], Any]) -> float:
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def refs_not_served(job: EncodeJob) -> WireError:
    """A job that still has no bytes (refs are resolved before the batch functions run)."""
    return WireError(ErrorCode.INVALID_REQUEST, "the part has no bytes", f"parts.{job.part}")


def claim_resolver(settings: Settings) -> Any:
    from pathlib import Path


    lim = settings.limits
    return ClaimResolver(settings.redis.url, Path(lim.ref_file_root) if lim.ref_file_root else None,
                         lim.max_ref_bytes)


def load_engine(settings: Settings, metrics: Observer, model: str, stage: str, engine_cls: Any = None,
                precision: str | None = None) -> tuple[Any, Any]:
    """(model config, loaded engine) for ``model``, served by the backend its config names
    (``workers.engines``); reports the engine, and each variant the fidelity gate or a
    failed load refused on the way, on the metrics. ``engine.precision`` is the variant
    that serves (the requested one, or fp32 after a fallback). ``engine_cls`` (a class
    keeping the engine contract) overrides the config's backend, without fallback."""

    config = ModelRepository(settings.models.repository).resolve(model)
    options = EngineOptions.from_settings(settings.encoder)
    precision = precision or settings.encoder.precision
    if engine_cls is not None:
        engine = engine_cls.from_options(config, precision, options)
        engine.load()
    else:
        engine = engines.load_engine(config, precision, options, stage=stage, observer=metrics)
    info = engine.info
    metrics.set_engine(stage, dataclasses.asdict(info))
    log.info("%s: %s", stage, info)
    return config, engine


def text_runner(settings: Settings, metrics: Observer, stage: str = "encode.text") -> Runner:
    config, engine = load_engine(settings, metrics, settings.models.text_model, stage)
    pre = TextPreprocessor(config.tokenizer_path, config.max_length)
    encoder = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
    encoder.warmup()
    run = with_cache(settings, metrics, "text", lambda jobs: encoder.run_batch([j.text for j in jobs]),
                     lambda job: normalize(job.text or "").encode(), config, text.PREPROCESSING_VERSION,
                     settings.cache.ttl_text_s, engine.precision)

    def calibrate() -> tuple[float, float]:
        texts = list(_WARMUP_TEXTS)
        return float(sum(pre.count_tokens(t) for t in texts)), _timed(lambda: encoder.embed(texts))

    identity = f"{config.name}/{config.version}/{engine.precision}/{text.PREPROCESSING_VERSION}"
    return Runner(run, lambda job: float(pre.count_tokens(job.text or "")), calibrate, identity)


def image_runner(settings: Settings, metrics: Observer, stage: str = "encode.image") -> tuple[Runner, Any]:
    """The image pool's runner (photos and video frame chunks) and the ImageEncoder itself."""
    config, engine = load_engine(settings, metrics, settings.models.image_model, stage)
    encoder = ImageEncoder(engine, load_labels(config.directory / "labels.json"),
                           max_pixels=settings.limits.max_image_pixels)
    encoder.warmup()

    def frame_chunk(job: EncodeJob) -> Any:
        """A video's frame chunk: the SUM of its frames' embeddings (the assembler pools)."""
        try:
            outputs = encoder.encode(frames_from_bytes(job.data or b""))
        except Exception as exc:
            return exc
        return Encoded(np.sum([o.embedding for o in outputs], axis=0),
                       {"frames": len(outputs), "labels": [o.top5[0][0] for o in outputs],
                        "top": [[[label, round(p, 4)] for label, p in o.top5[:3]] for o in outputs]})

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        photos = [j for j in jobs if j.data is not None and j.mime != FRAMES_MIME]
        results = iter(encoder.run_batch([(j.data, j.mime) for j in photos]))
        out: list[Any] = []
        for j in jobs:
            if j.data is None:
                out.append(refs_not_served(j))
            elif j.mime == FRAMES_MIME:
                out.append(frame_chunk(j))
            else:
                r = next(results)
                out.append(r if isinstance(r, Exception) else
                           Encoded(r.embedding, {"top5": [[label, round(p, 5)] for label, p in r.top5]}))
        return out

    def cost(job: EncodeJob) -> float:
        # Every image is resized to 224x224 before the engine: one image (or frame) is one unit.
        return max(1.0, len(job.data or b"") / FRAME_BYTES) if job.mime == FRAMES_MIME else 1.0


    def content(job: EncodeJob) -> bytes | None:
        # Photos by the pixels the model sees (the same picture hits however it was
        # encoded); frame chunks are raw pixels already.
        if job.data is None or job.mime == FRAMES_MIME:
            return job.data
        return normalized_pixels(job.data, job.mime, settings.limits.max_image_pixels)

    run = with_cache(settings, metrics, "image", run_batch, content, config,
                     f"{image.PREPROCESSING_VERSION}+pixels+{FRAMES_MIME}", settings.cache.ttl_image_s, engine.precision)

    def calibrate() -> tuple[float, float]:
        images = [_warmup_image(seed) for seed in range(4)]
        return 4.0, _timed(lambda: encoder.encode(images))

    identity = f"{config.name}/{config.version}/{engine.precision}/{image.PREPROCESSING_VERSION}"
    return Runner(run, cost, calibrate, identity), encoder


def audio_runner(settings: Settings, metrics: Observer, stage: str = "encode.audio") -> Runner:
    """Whisper through CTranslate2: transcript plus the speech-pooled encoder embedding."""
    config, engine = load_engine(settings, metrics, settings.models.audio_model, stage,
                                 precision=settings.models.audio_precision)
    encoder = AudioEncoder(engine, max_seconds=settings.limits.max_audio_seconds)
    encoder.warmup()

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        inline = [j for j in jobs if j.data is not None]
        results = iter(encoder.run_batch([(j.data, j.mime) for j in inline]))
        out: list[Any] = []
        for j in jobs:
            if j.data is None:
                out.append(refs_not_served(j))
                continue
            r = next(results)
            out.append(r if isinstance(r, Exception) else Encoded(r.embedding, {
                "transcript": r.transcript, "speech_seconds": round(r.speech_seconds, 3), "language": r.language}))
        return out


    max_s = settings.limits.max_audio_seconds
    # Keyed by the speech the model hears (decoded, resampled, VAD-trimmed): a few ms of
    # work that saves Whisper's hundreds when the same words come again.
    run = with_cache(settings, metrics, "audio", run_batch,
                     lambda job: normalized_speech(job.data, job.mime, max_s) if job.data else None,
                     config, f"{audio.PREPROCESSING_VERSION}+speech", settings.cache.ttl_image_s, engine.precision)
    identity = f"{config.name}/{config.version}/{engine.precision}/{audio.PREPROCESSING_VERSION}"
    return Runner(run, lambda job: 1.0, identity=identity)


def generic_runner(settings: Settings, metrics: Observer) -> Runner:
    """The no-routing baseline: one pool for every modality, one queue, one batch loop.
    A video is decoded and its frames encoded right here, not fanned out."""

    text = text_runner(settings, metrics, "encode.any")
    image, image_encoder = image_runner(settings, metrics, "encode.any")
    v = settings.video

    def video(job: EncodeJob) -> Any:
        try:
            if job.data is None:
                raise refs_not_served(job)
            clip = decode_video(job.data, v.max_seconds, v.max_frames, v.fps)
            from PIL import Image

            outs = image_encoder.encode([Image.fromarray(f) for f in clip.frames])
        except Exception as exc:
            return exc
        pooled = np.mean([o.embedding for o in outs], axis=0)
        pooled /= max(float(np.linalg.norm(pooled)), 1e-12)
        return Encoded(pooled, {"duration_s": round(clip.duration_s, 3), "frames_sampled": len(outs),
                                "frames_encoded": len(outs), "complete": True, "has_audio": clip.has_audio,
                                "frame_labels": [o.top5[0][0] for o in outs]})

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        out: list[Any] = [None] * len(jobs)
        for modality, runner in (("text", text.run_batch), ("image", image.run_batch)):
            idx = [i for i, j in enumerate(jobs) if j.modality == modality]
            for i, r in zip(idx, runner([jobs[i] for i in idx]) if idx else []):
                out[i] = r
        for i, j in enumerate(jobs):
            if j.modality == "video":
                out[i] = video(j)
            elif out[i] is None:
                out[i] = WireError(ErrorCode.UNSUPPORTED_MEDIA, f"no {j.modality} encoder in the generic pool",
                                   f"parts.{j.part}")
        return out

    # One queue for everything: a job is a job (what makes text wait behind video).
    return Runner(run_batch, lambda job: 1.0)


def with_cache(settings: Settings, metrics: Observer, modality: str, run_batch: Any,
               content: Callable[[EncodeJob], bytes | None], config: Any, preprocessing: str, ttl_s: int,
               precision: str | None = None) -> Any:
    """``run_batch`` behind the Redis reuse cache, or as it is when the cache is off.
    ``precision`` is the variant that serves (after a fallback it is not the one asked for);
    None: the encoder setting."""
    if not settings.cache.enabled:
        return run_batch

    c = settings.cache
    cache = EncoderCache(settings.redis.url, ttl_s, c.timeout_ms / 1000.0,
                         CircuitBreaker(c.breaker_failures, c.breaker_cooldown_s))

    def key_of(job: EncodeJob) -> str | None:
        data = content(job)
        if not data:
            return None
        return cache_key(modality=modality, digest=content_digest(data), model=config.name, version=config.version,
                         precision=precision or settings.encoder.precision, preprocessing=preprocessing,
                         tenant=None if c.cross_tenant else job.tenant)

    return CachingBatch(run_batch, key_of, cache, metrics, modality)
