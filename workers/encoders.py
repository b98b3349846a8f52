"""What every encode stage's batch function is built from: ``Runner`` (the function the
engine thread calls with a batch of jobs, one output or exception per job, and the cost of
one job for the batcher), the engine loader, the claim-check resolver and the reuse cache.

Each modality builds its own runner from these in ``workers/modalities/<name>.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers.breaker import CircuitBreaker
from workers.cache import CachingBatch, EncoderCache
from workers.cache_keys import cache_key, content_digest
from workers.claims import ClaimResolver
from workers import engines
from workers.engines import EngineOptions
from workers.outputs import Observer
from workers.repository import ModelRepository

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runner:
    run_batch: Callable[[list[EncodeJob]], list[Any]]
    """One output (``Encoded``, an embedding, or that job's exception) per job, in order."""
    cost: Callable[[EncodeJob], float]
    """Work units of one job, for the batcher's budget and the cost observer."""
    calibrate: Callable[[], tuple[float, float]] | None = None
    """Times one representative batch on the engine itself (no cache): (units, ms). The
    router's cost model starts from it before any real traffic has been observed."""
    identity: str = ""
    """name/version/precision/preprocessing: what the whole-result cache keys on."""


def timed(fn: Callable[[], Any]) -> float:
    """Wall milliseconds of one call of ``fn``."""
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
