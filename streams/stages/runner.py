"""Run one stage of the pipeline in this process: `mmstream worker <stage>`.

A stage's engine loads and warms up before its Faust worker starts, so the worker joins
its consumer group only when it can serve at full speed. Every worker serves Prometheus
metrics on its own port and writes the bound port next to its pid file.

Modality plugins (``MMSTREAM_MODALITIES_PLUGINS``) are loaded first, so the topics, the
stage names and every table read from the modality registry include them. An encode stage
runs its modality's compute (``ModalitySpec.front``) in an ``EncoderStage``; a modality that
fans out runs its fan-out loop from ``FANOUT_STAGES``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import faust

from schemas.settings import Settings
from schemas.settings_base import csv_items
from streams.app import create_app, group_id
from streams.observe.health import process_health
from streams.observe.lagmon import run_lag_monitor
from streams.observe.http import serve
from streams.observe.metrics import Metrics
from streams.runtime.heap import freeze_heap
from streams.connection import client_kwargs
from streams.stages import BASELINE_POOL, stage_names
from streams.stages.encoder import EncoderStage
from streams.topics import ensure_topics, topic_specs
from workers import modalities
from workers.encoders import EncoderFront, claim_resolver
from workers.outputs import EncoderRunner

log = logging.getLogger(__name__)


Installer = Callable[[faust.App, Settings, Metrics], None]
Build = Callable[[Settings, Metrics], EncoderRunner]

def _lazy(where: str) -> Installer:
    """The installer ``"module:function"``, imported when called: a worker imports its own
    stage's module only (each import is part of its cold start, docs/autoscaling.md)."""
    def install(app: faust.App, settings: Settings, metrics: Metrics) -> None:
        import importlib

        module, _, name = where.partition(":")
        getattr(importlib.import_module(module), name)(app, settings, metrics)

    return install


FANOUT_STAGES: dict[str, Installer] = {"video": _lazy("streams.stages.video:install_video_fanout")}
"""Fan-out loops by modality: the stage of a modality whose spec fans out instead of encoding."""


def _encoder_installer(modality: str, build: Build) -> Installer:
    def install(app: faust.App, settings: Settings, metrics: Metrics) -> None:
        EncoderStage(app, settings, metrics, modality, build(settings, metrics),
                     debt_nice=settings.quota.debt_nice).install()

    return install


def _generic(settings: Settings, metrics: Metrics) -> EncoderRunner:
    # The no-routing baseline: claim checks, no reuse cache (its parts have no one model).
    from workers.modalities.generic import generic_runner

    return EncoderFront(generic_runner(settings, metrics), claim_resolver(settings), None)


def _router(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    """The router, and the encoders ``router.colocate`` places in its process (each in its
    pool's consumer group, unless ``router.colocate_pool`` is off)."""
    from streams.stages.router import install_router

    encoders = []
    served = modalities.served(settings)
    for name in csv_items(settings.router.colocate):
        spec = modalities.get(name)
        if spec is None or spec.runner is None:
            raise ValueError(f"router.colocate: {name!r} is not a modality with an encoder of its own "
                             f"(encoders: {', '.join(s.name for s in modalities.specs() if s.runner is not None)})")
        if name not in served or not settings.router.modality_topics:
            continue  # its parts are refused, or go to the shared pool: an engine here would never run
        try:
            runner = spec.front(settings, metrics, spec.stage)
        except Exception:  # the placement only saves a hop: route without it rather than not at all
            log.exception("router: the %s encoder could not be built in this process; its parts go through "
                          "their topic to the %s pool", name, spec.stage)
            continue
        encoders.append(EncoderStage(app, settings, metrics, spec.name, runner,
                                     group_id=group_id(settings.kafka.topic_prefix, spec.stage),
                                     intake=settings.router.colocate_pool,
                                     thread_nice=settings.router.nice_of(name)))
    install_router(app, settings, metrics, encoders)


def embedder(settings: Settings, metrics: Metrics, stage: str, modality: str = "text") -> Any:
    """The encoder ``encode.<modality>`` serves, in this process (same model, version,
    cache): a ``workers.retrieval.embed.Embedder`` (reading a document's ref at most
    ``retrieval.max_doc_image_bytes`` far)."""
    from workers.retrieval.embed import Embedder

    spec = modalities.get(modality)
    if spec is None or spec.runner is None:
        raise ValueError(f"the retrieval stages need the {modality} modality's encoder")
    return Embedder(spec.front(settings, metrics, stage), modality, settings.retrieval.max_doc_image_bytes)


def _indexer(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    """Passages with the text encoder; images too where the deployment serves images."""
    from streams.stages.indexer import install_indexer

    embedders = {"text": embedder(settings, metrics, "index")}
    if "image" in modalities.served(settings):
        embedders["image"] = embedder(settings, metrics, "index", "image")
    install_indexer(app, settings, metrics, embedders)


def _retrieve(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    from streams.stages.retrieve import install_retrieve

    install_retrieve(app, settings, metrics, embedder(settings, metrics, "retrieve"))


def _installer(stage: str) -> Installer:
    fixed = {"router": _router, "assembler": _lazy("streams.stages.assembler:install_assembler"),
             "generate": _lazy("streams.stages.generator:install_generator"),
             "index": _indexer, "retrieve": _retrieve, BASELINE_POOL: _encoder_installer("any", _generic)}
    if stage in fixed:
        return fixed[stage]
    spec = modalities.get(stage.removeprefix("encode.")) if stage.startswith("encode.") else None
    if spec is None:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(stage_names())}")
    if spec.runner is not None:
        return _encoder_installer(spec.name, lambda settings, metrics: spec.front(settings, metrics, spec.stage))
    if spec.name not in FANOUT_STAGES:
        raise ValueError(f"modality {spec.name!r} fans out to {spec.fanout} but no fan-out stage is written for it")
    return FANOUT_STAGES[spec.name]


def build_stage(settings: Settings, stage: str, metrics: Metrics, replica: int = 0) -> faust.App:
    """The Faust app of ``stage`` with its record loops installed (and its engine warm)."""
    install = _installer(stage)
    app = create_app(settings, stage, replica)
    install(app, settings, metrics)
    return app


def port_file(settings: Settings, stage: str, replica: int) -> Any:
    return settings.local.state_dir / "workers" / settings.kafka.topic_prefix / f"{stage}-{replica}.port"


def run_stage(settings: Settings, stage: str, replica: int = 0, loglevel: str = "info") -> None:
    """Load the modality plugins, create the topics, build the stage, serve its metrics and
    run it until SIGTERM/SIGINT."""
    born = process_health().born_at  # the fork, or a warm spare's hand-over (mmstream.standby)
    log.info("%s[%d]: cold start: imports done %.2fs after start", stage, replica, time.time() - born)
    modalities.load_plugins(settings.modalities.plugins)
    asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka, settings.dlq), settings.kafka.replication_factor,
                              client_kwargs(settings)))
    if stage == "lagmon":

        run_lag_monitor(settings, settings.metrics.port, settings.metrics.lag_interval_s,
                        on_bound=lambda port: _write_port(settings, stage, replica, port))
        return
    log.info("%s[%d]: cold start: topics checked %.2fs after start", stage, replica, time.time() - born)
    metrics = Metrics()
    app = build_stage(settings, stage, metrics, replica)
    log.info("%s[%d]: cold start: engine loaded and warm %.2fs after start", stage, replica, time.time() - born)
    _write_port(settings, stage, replica, serve(settings.metrics.port, metrics.registry, settings.metrics.bind))
    frozen = freeze_heap()
    log.info("%s[%d]: %d objects built at start-up left out of the garbage collector's scans", stage, replica, frozen)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


def _write_port(settings: Settings, stage: str, replica: int, port: int) -> None:
    path = port_file(settings, stage, replica)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(port))
    log.info("%s[%d]: metrics on http://%s:%d/metrics", stage, replica, settings.metrics.bind, port)
