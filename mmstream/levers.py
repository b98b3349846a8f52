"""Turning the latency levers off for one benchmark run, on a pipeline of its own.

A lever is a setting of the workers (or of the traffic), so comparing "with" and "without"
means running the same traffic against two pipelines configured differently. `own_pipeline`
starts one under a fresh topic prefix with the lever's settings, waits until it answers,
and stops it afterwards; the broker and Redis are shared.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from mmstream.lever_names import LEVERS
from mmstream.supervisor import Supervisor
from schemas.request import Task
from schemas.settings import Settings
from streams.sdk.client import wait_until_serving
from streams.connection import KafkaSecurity, client_kwargs
from streams.runtime.parent import PARENT_PID_ENV
from streams.topics import ensure_topics, topic_specs


# What switching each lever off means for the workers' settings. `lanes` off is a property
# of the traffic (every request is sent on the rt lane), so it changes no setting.
OFF_ENV = {
    "routing": {"MMSTREAM_ROUTER_MODALITY_TOPICS": "false"},
    "cache": {"MMSTREAM_CACHE_ENABLED": "false"},
    "admission": {"MMSTREAM_ADMISSION_ENABLED": "false"},
    "lanes": {},
    "grouping": {"MMSTREAM_ENCODER_GROUPING": "fifo"},
    "placement": {"MMSTREAM_ROUTER_COLOCATE": ""},
}


def replicas(off: tuple[str, ...], workload: str) -> dict[str, int]:
    """One worker per stage the workload needs (the generic pool when routing is off)."""
    stages = {"router": 1, "assembler": 1}
    if workload in ("retrieve", "rag", "retrieve-images"):  # queries embed on encode.*; the corpus through index
        stages.update({"encode.text": 1, "index": 1, "retrieve": 1})
        if workload == "retrieve-images":
            stages["encode.image"] = 1
        if workload == "rag":
            stages["generate"] = 1
        return stages
    if workload in ("chat", "chat-mm"):  # text parts of generate requests need no encoder
        stages["generate"] = 1
        stages["encode.text"] = 1  # answers the embed probes of the bench
        if workload == "chat-mm":
            stages["encode.image"] = 1  # labels the photos the questions are about
        return stages
    if "routing" in off:
        stages["encode.any"] = 1
    else:
        stages["encode.text"] = 1
        if workload != "text":  # photos, videos (frames and soundtracks) and spoken clips
            stages["encode.image"] = 1
            stages["encode.video"] = 1
            stages["encode.audio"] = 1
    return stages


def lever_env(off: tuple[str, ...], prefix: str) -> dict[str, str]:
    unknown = set(off) - set(LEVERS)
    if unknown:
        raise ValueError(f"unknown lever(s) {', '.join(sorted(unknown))}; levers: {', '.join(LEVERS)}")
    env = {"MMSTREAM_KAFKA_TOPIC_PREFIX": prefix, "MMSTREAM_LOCAL_METRICS_BASE_PORT": "0"}
    for lever in off:
        env.update(OFF_ENV[lever])
    return env


@asynccontextmanager
async def own_pipeline(settings: Settings, off: tuple[str, ...], workload: str,
                       timeout_s: float = 180.0, extra_env: dict[str, str] | None = None,
                       extra_replicas: dict[str, int] | None = None) -> AsyncIterator[Settings]:
    """Settings of a fresh pipeline with the levers ``off`` switched off (and the workers of
    ``extra_replicas`` too: the local scaler), running for the duration of the block."""

    env = {**os.environ, **lever_env(off, f"bench{uuid.uuid4().hex[:8]}"), **(extra_env or {}),
           PARENT_PID_ENV: str(os.getpid())}  # its workers stop if this process is killed
    run_settings = Settings.from_env(env)
    await ensure_topics(run_settings.kafka.bootstrap, topic_specs(run_settings.kafka, run_settings.dlq),
                        run_settings.kafka.replication_factor, client_kwargs(run_settings))
    supervisor = Supervisor(run_settings, env)
    await asyncio.to_thread(supervisor.start, {**replicas(off, workload), **(extra_replicas or {})})
    try:
        # A chat run starts once the generator answers too (it loads and calibrates after the rest).
        task = Task.GENERATE if workload.startswith("chat") or workload == "rag" else Task.EMBED
        await wait_until_serving(run_settings.kafka.bootstrap, run_settings.kafka.topic_prefix, timeout_s,
                                 KafkaSecurity.from_settings(run_settings.kafka), task=task)
        yield run_settings
    finally:
        await asyncio.to_thread(supervisor.stop)
