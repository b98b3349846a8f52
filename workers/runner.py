"""Run one stage of the pipeline in this process: `mmstream worker <stage>`.

A stage's engine loads and warms up before its Faust worker starts, so the worker joins
its consumer group only when it can serve at full speed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import faust

from streams.app import create_app
from streams.settings import Settings
from streams.topics import ensure_topics, topic_specs

log = logging.getLogger(__name__)

STAGES = ("router", "assembler", "encode.text")


def _install_text_encoder(app: faust.App, settings: Settings) -> None:
    from workers.encode_worker import EncoderLoop
    from workers.engine import OnnxEngine
    from workers.repository import ModelRepository
    from workers.text import TextEncoder, TextPreprocessor

    config = ModelRepository(settings.models.repository).resolve(settings.models.text_model)
    engine = OnnxEngine(config, settings.encoder.precision, settings.encoder.intra_op_threads,
                        allow_spinning=settings.encoder.allow_spinning)
    info = engine.load()
    pre = TextPreprocessor(config.tokenizer_path, config.max_length)
    encoder = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
    encoder.warmup()
    log.info("encode.text: %s", info)
    loop = EncoderLoop(app, settings, "text", lambda jobs: encoder.run_batch([j.text for j in jobs]),
                       cost=lambda job: float(pre.count_tokens(job.text or "")))
    loop.install()


def _installer(stage: str) -> Callable[[faust.App, Settings], None]:
    if stage == "router":
        from streams.agents import install_router
        return install_router
    if stage == "assembler":
        from streams.agents import install_assembler
        return install_assembler
    if stage == "encode.text":
        return _install_text_encoder
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def build_stage(settings: Settings, stage: str, replica: int = 0) -> faust.App:
    """The Faust app of ``stage`` with its agents installed (and its engine warm)."""
    install = _installer(stage)
    app = create_app(settings, stage, replica)
    install(app, settings)
    return app


def run_stage(settings: Settings, stage: str, replica: int = 0, loglevel: str = "info") -> None:
    """Create the topics, build the stage and run its worker until SIGTERM/SIGINT."""
    asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka), settings.kafka.replication_factor))
    app = build_stage(settings, stage, replica)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
