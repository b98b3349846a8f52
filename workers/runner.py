"""Run one stage of the pipeline in this process: `mmstream worker <stage>`.

A stage's engine loads and warms up before its Faust worker starts, so the worker joins
its consumer group only when it can serve at full speed. Every worker serves Prometheus
metrics on its own port and writes the bound port next to its pid file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable

import faust
import numpy as np

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from streams.app import create_app
from streams.metrics import Metrics, serve
from streams.settings import Settings
from streams.topics import ensure_topics, topic_specs

log = logging.getLogger(__name__)

STAGES = ("router", "assembler", "encode.text", "encode.image", "encode.video", "lagmon")

Installer = Callable[[faust.App, Settings, Metrics], None]


def _refs_not_served(job: EncodeJob) -> WireError:
    return WireError(ErrorCode.INVALID_REQUEST, "claim-check refs are not served yet; send the bytes inline",
                     f"parts.{job.part}.ref")


def _install_text_encoder(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    from workers.encode_worker import EncoderLoop
    from workers.engine import OnnxEngine
    from workers.repository import ModelRepository
    from workers.text import TextEncoder, TextPreprocessor

    config = ModelRepository(settings.models.repository).resolve(settings.models.text_model)
    engine = _engine(OnnxEngine, config, settings, metrics, "encode.text")
    pre = TextPreprocessor(config.tokenizer_path, config.max_length)
    encoder = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
    encoder.warmup()
    from workers.text import PREPROCESSING_VERSION, normalize

    run = _with_cache(settings, metrics, "text", lambda jobs: encoder.run_batch([j.text for j in jobs]),
                      lambda job: normalize(job.text or "").encode(), config, PREPROCESSING_VERSION,
                      settings.cache.ttl_text_s)
    EncoderLoop(app, settings, metrics, "text", run, cost=lambda job: float(pre.count_tokens(job.text or ""))).install()


def _install_image_encoder(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    from workers.encode_worker import Encoded, EncoderLoop
    from workers.engine import OnnxEngine
    from workers.image import ImageEncoder, load_labels
    from workers.repository import ModelRepository

    config = ModelRepository(settings.models.repository).resolve(settings.models.image_model)
    engine = _engine(OnnxEngine, config, settings, metrics, "encode.image")
    encoder = ImageEncoder(engine, load_labels(config.directory / "labels.json"),
                           max_pixels=settings.limits.max_image_pixels)
    encoder.warmup()

    from workers.video import FRAME_BYTES, FRAMES_MIME, frames_from_bytes

    def frame_chunk(job: EncodeJob) -> Any:
        """A video's frame chunk: the sum of its frames' embeddings (pooled by the assembler)."""
        try:
            outputs = encoder.encode(frames_from_bytes(job.data or b""))
        except Exception as exc:
            return exc
        return Encoded(np.sum([o.embedding for o in outputs], axis=0),
                       {"frames": len(outputs), "labels": [o.top5[0][0] for o in outputs]})

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        photos = [j for j in jobs if j.data is not None and j.mime != FRAMES_MIME]
        results = iter(encoder.run_batch([(j.data, j.mime) for j in photos]))
        out: list[Any] = []
        for j in jobs:
            if j.data is None:
                out.append(_refs_not_served(j))
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

    from workers.image import PREPROCESSING_VERSION

    # Keyed by the bytes as sent (not yet by decoded pixels): the same file hits.
    run = _with_cache(settings, metrics, "image", run_batch, lambda job: job.data, config,
                      f"{PREPROCESSING_VERSION}+{FRAMES_MIME}", settings.cache.ttl_image_s)
    EncoderLoop(app, settings, metrics, "image", run, cost=cost).install()


def _with_cache(settings: Settings, metrics: Metrics, modality: str, run_batch: Any,
                content: Callable[[EncodeJob], bytes | None], config: Any, preprocessing: str, ttl_s: int) -> Any:
    """``run_batch`` behind the Redis reuse cache, or as it is when the cache is off."""
    if not settings.cache.enabled:
        return run_batch
    from streams.policies.breaker import CircuitBreaker
    from streams.policies.cache_keys import cache_key, content_digest
    from workers.cache import CachingBatch, EncoderCache

    c = settings.cache
    cache = EncoderCache(settings.redis.url, ttl_s, c.timeout_ms / 1000.0,
                         CircuitBreaker(c.breaker_failures, c.breaker_cooldown_s))

    def key_of(job: EncodeJob) -> str | None:
        data = content(job)
        if not data:
            return None
        return cache_key(modality=modality, digest=content_digest(data), model=config.name, version=config.version,
                         precision=settings.encoder.precision, preprocessing=preprocessing,
                         tenant=None if c.cross_tenant else job.tenant)

    return CachingBatch(run_batch, key_of, cache, metrics, modality)


def _engine(engine_cls: Any, config: Any, settings: Settings, metrics: Metrics, stage: str) -> Any:
    engine = engine_cls(config, settings.encoder.precision, settings.encoder.intra_op_threads,
                        allow_spinning=settings.encoder.allow_spinning)
    info = engine.load()
    metrics.set_engine(stage, dataclasses.asdict(info))
    log.info("%s: %s", stage, info)
    return engine


def _installer(stage: str) -> Installer:
    if stage == "router":
        from streams.agents import install_router
        return install_router
    if stage == "assembler":
        from streams.agents import install_assembler
        return install_assembler
    if stage == "encode.text":
        return _install_text_encoder
    if stage == "encode.image":
        return _install_image_encoder
    if stage == "encode.video":
        from workers.video_stage import install_video_fanout
        return install_video_fanout
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def build_stage(settings: Settings, stage: str, metrics: Metrics, replica: int = 0) -> faust.App:
    """The Faust app of ``stage`` with its agents installed (and its engine warm)."""
    install = _installer(stage)
    app = create_app(settings, stage, replica)
    install(app, settings, metrics)
    return app


def port_file(settings: Settings, stage: str, replica: int) -> Any:
    return settings.local.state_dir / "workers" / settings.kafka.topic_prefix / f"{stage}-{replica}.port"


def run_stage(settings: Settings, stage: str, replica: int = 0, loglevel: str = "info") -> None:
    """Create the topics, build the stage, serve its metrics and run it until SIGTERM/SIGINT."""
    asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka), settings.kafka.replication_factor))
    if stage == "lagmon":
        from streams.lagmon import run_lag_monitor

        run_lag_monitor(settings, settings.metrics.port, settings.metrics.lag_interval_s,
                        on_bound=lambda port: _write_port(settings, stage, replica, port))
        return
    metrics = Metrics()
    app = build_stage(settings, stage, metrics, replica)
    _write_port(settings, stage, replica, serve(settings.metrics.port, metrics.registry, settings.metrics.bind))
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


def _write_port(settings: Settings, stage: str, replica: int, port: int) -> None:
    path = port_file(settings, stage, replica)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(port))
    log.info("%s[%d]: metrics on http://%s:%d/metrics", stage, replica, settings.metrics.bind, port)
