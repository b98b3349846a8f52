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
from pathlib import Path
from typing import Any, Callable

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers.breaker import CircuitBreaker
from workers.cache import CacheFront, EncoderCache
from workers.cache_keys import cache_key, content_digest
from workers.claims import ClaimResolver
from workers import engines
from workers.engines import EngineOptions
from workers.outputs import Encoded, Observer, Prepared
from workers.repository import ModelRepository

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runner:
    """A modality's compute, in the two halves the encode stage overlaps."""

    prepare: Callable[[EncodeJob], Prepared]
    """The CPU work before the model for one job with bytes (decode, resize, tokenize);
    raises that job's own error (a ``WireError`` for input it refuses)."""
    run: Callable[[list[Prepared]], list[Any]]
    """The engine call: one output (``Encoded``, an embedding, or that item's exception) per
    prepared item, in order; one bad item must not fail the others."""
    calibrate: Callable[[], list[tuple[int, float, float]]] | None = None
    """Times a few batches on the engine itself (no cache): (rows, length, ms) each. The
    batch cost model starts from them before any real traffic has been observed."""
    identity: str = ""
    """name/version/precision/preprocessing: what the whole-result cache keys on."""
    variable_length: bool = False
    """Items differ in length and a batch pads to its longest (text): group by length."""
    cost_prior: tuple[float, float, float] = (1.0, 10.0, 0.0)
    """(c0, c1, c2) of ``c0 + c1·n·L + c2·n·L²`` ms before calibration (see
    ``streams.policies.cost_model``)."""
    rows_alone: bool = False
    """``run`` executes a batch's rows one by one (an engine whose outputs depend on their
    batch): the fixed cost is per row, company saves nothing, so no item waits for it."""
    config: Any = None
    """The model's ``ModelConfig`` (its name and version key the reuse cache)."""
    precision: str = ""
    """The variant that serves (``engine.precision``: after a fidelity fallback, not always
    the one asked for); it keys the reuse cache."""
    cache_content: Callable[[EncodeJob, Settings], bytes | None] | None = None
    """The bytes the reuse-cache key hashes for a job: what the model sees after
    normalization, so equal content hits however it was encoded (``Prepared.content`` gives
    them when ``prepare`` already made them). None: this modality is not cached."""
    preprocessing: str = ""
    """Preprocessing version in the cache key: bump it when ``cache_content`` or the
    preprocessing changes what the model is given."""
    prepare_heavy: Callable[[EncodeJob], Prepared] | None = None
    """``prepare`` for a job priced as heavy (``encoder.heavy_prep_ms``), where the modality
    does that elsewhere (images: in a low-priority process of its own, ``workers.offload``).
    None: ``prepare``."""


class EncoderFront:
    """What an encode stage drives (``workers.outputs.EncoderRunner``): a ``Runner`` with
    claim checks resolved and the reuse cache in front, one method per hand of the stage."""

    def __init__(self, runner: Runner, resolver: "ClaimResolver | None", cache: CacheFront | None,
                 cache_content: Callable[[EncodeJob], bytes | None] | None = None,
                 key_of: Callable[[EncodeJob, bytes], str] | None = None) -> None:
        self.runner = runner
        self.resolver = resolver
        self.cache = cache
        self.cache_content = cache_content
        self.key_of = key_of
        self.identity = runner.identity
        self.variable_length = runner.variable_length
        self.cost_prior = runner.cost_prior
        self.rows_alone = runner.rows_alone

    def prepare_many(self, jobs: list[EncodeJob]) -> list[Any]:
        """Prep thread: per job its exception, a cache hit (``Encoded``), or its ``Prepared``."""
        return self.lookup(self.prepare_items(jobs))

    def prepare_items(self, jobs: list[EncodeJob], heavy: bool = False) -> list[Any]:
        """Per job its exception or its ``Prepared`` (the cache not asked yet); ``heavy``: jobs
        priced as heavy, prepared by ``Runner.prepare_heavy`` where there is one."""
        prepare = (self.runner.prepare_heavy if heavy else None) or self.runner.prepare
        prepared: list[Any] = []
        for job in jobs:
            try:
                if job.ref is not None:  # a claim check: its bytes, fetched here (never on the engine's time)
                    if self.resolver is None:
                        raise refs_not_served(job)
                    data = self.resolver.fetch(job.ref, f"parts.{job.part}.ref", job.tenant, job.ref_bytes)
                    job = dataclasses.replace(job, data=data, ref=None)
                elif job.data is None and job.text is None:
                    raise refs_not_served(job)
                item = prepare(job)
                prepared.append(dataclasses.replace(item, key=self._key(item)))
            except Exception as exc:
                prepared.append(exc)
        return prepared

    def lookup(self, prepared: list[Any], wait_for_others: bool = True) -> list[Any]:
        """``prepared`` with the reuse cache's hits in place of their items (see
        ``CacheFront.lookup`` for ``wait_for_others``)."""
        if self.cache is None:
            return prepared
        hits = self.cache.lookup([p.key if isinstance(p, Prepared) else None for p in prepared], wait_for_others)
        return [hit if hit is not None else p for p, hit in zip(prepared, hits)]

    def _key(self, item: Prepared) -> str | None:
        if self.cache is None or self.key_of is None:
            return None
        content = item.content if item.content is not None else (
            self.cache_content(item.job) if self.cache_content is not None else None)
        return self.key_of(item.job, content) if content else None

    def run(self, items: list[Prepared]) -> list[Any]:
        """Engine thread: identical cache keys in one batch run once."""
        todo: list[Prepared] = []
        runs_at: dict[str, int] = {}
        slots: list[int] = []
        for item in items:
            if item.key is not None and item.key in runs_at:
                slots.append(runs_at[item.key])
                continue
            if item.key is not None:
                runs_at[item.key] = len(todo)
            slots.append(len(todo))
            todo.append(item)
        computed = [r if isinstance(r, (Encoded, Exception)) else Encoded(r, {}) for r in self.runner.run(todo)]
        return [computed[s] for s in slots]

    def store(self, writes: list[tuple[str, Encoded]]) -> None:
        if self.cache is not None:
            self.cache.store(writes)

    def calibrate(self) -> list[tuple[int, float, float]]:
        return self.runner.calibrate() if self.runner.calibrate is not None else []


def timed(fn: Callable[[], Any]) -> float:
    """Wall milliseconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def refs_not_served(job: EncodeJob) -> WireError:
    """A job that still has no bytes (refs are resolved before the batch functions run)."""
    return WireError(ErrorCode.INVALID_REQUEST, "the part has no bytes", f"parts.{job.part}")


def claim_resolver(settings: Settings) -> Any:
    lim = settings.limits
    return ClaimResolver(settings.redis.url, Path(lim.ref_file_root) if lim.ref_file_root else None,
                         lim.max_ref_bytes, tls_ca=settings.redis.tls_ca)


def load_engine(settings: Settings, metrics: Observer, model: str, stage: str,
                precision: str | None = None) -> tuple[Any, Any]:
    """(model config, loaded engine) for ``model``, served by the backend its config names
    (``workers.engines``); reports the engine, and each variant the fidelity gate or a
    failed load refused on the way, on the metrics. ``engine.precision`` is the variant
    that serves (the requested one, or fp32 after a fallback)."""

    config = ModelRepository(settings.models.repository).resolve(model)
    options = EngineOptions.from_settings(settings.encoder)
    precision = precision or settings.encoder.precision
    engine = engines.load_engine(config, precision, options, stage=stage, observer=metrics)
    info = engine.info
    metrics.set_engine(stage, dataclasses.asdict(info))
    log.info("%s: %s", stage, info)
    return config, engine


def cache_front(settings: Settings, metrics: Observer, modality: str, config: Any, preprocessing: str,
                ttl_s: int, precision: str) -> tuple[CacheFront | None, Callable[[EncodeJob, bytes], str] | None]:
    """The reuse cache for ``modality`` and how a job's content becomes its key; (None,
    None) when the cache is off. ``precision`` is the variant that serves (after a fidelity
    fallback it is not the one asked for), so a fallback never answers from another
    variant's entries."""
    if not settings.cache.enabled:
        return None, None
    c = settings.cache
    cache = EncoderCache(settings.redis.url, ttl_s, c.timeout_ms / 1000.0,
                         CircuitBreaker(c.breaker_failures, c.breaker_cooldown_s), tls_ca=settings.redis.tls_ca)

    def key_of(job: EncodeJob, content: bytes) -> str:
        return cache_key(modality=modality, digest=content_digest(content), model=config.name, version=config.version,
                         precision=precision, preprocessing=preprocessing,
                         tenant=None if c.cross_tenant else job.tenant)

    return CacheFront(cache, metrics, modality), key_of


BATCH_INVARIANT_COSINE = 0.9999
"""A variant whose build measured rows in a batch this close to the same rows alone is
batch-invariant (fp32, static int8); under it, a row's answer depends on its batch-mates."""


def batch_dependent(config: Any, precision: str) -> bool:
    """Whether ``precision``'s rows change with their batch-mates, from what its build measured."""
    variant = config.variants.get(precision)
    measured = (variant.fidelity or {}).get("batch_vs_alone_min_cosine") if variant is not None else None
    return measured is not None and float(measured) < BATCH_INVARIANT_COSINE


def run_isolated(items: list[Any], run: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """``run`` the batch; if that fails, each item alone, so one bad item (or one that makes
    the batch too large) fails only itself. One output or exception per item."""
    if not items:
        return []
    try:
        return list(run(items))
    except Exception as batch_error:
        if len(items) == 1:
            return [batch_error]
        log.warning("batch of %d failed (%s); retrying one by one", len(items), batch_error)
    out: list[Any] = []
    for item in items:
        try:
            out.extend(run([item]))
        except Exception as item_error:
            out.append(item_error)
    return out


def front_for(runner: Runner, settings: Settings, observer: Observer, modality: str, ttl_s: int) -> EncoderFront:
    """``runner`` with claim checks resolved and, when it says what its cache key hashes
    (``Runner.cache_content``) and the cache is on, the reuse cache in front."""
    cache, key_of = (None, None)
    cache_content = runner.cache_content
    if cache_content is not None and runner.config is not None:
        cache, key_of = cache_front(settings, observer, modality, runner.config, runner.preprocessing, ttl_s,
                                    runner.precision or settings.encoder.precision)
    content = (lambda job: cache_content(job, settings)) if cache_content is not None else None
    return EncoderFront(runner, claim_resolver(settings), cache, content, key_of)
