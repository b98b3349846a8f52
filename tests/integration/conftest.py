"""Shared real infrastructure for integration tests: one broker and one Redis per session
(started like `mmstream up` does, and stopped afterwards if this session started them), and
one pipeline of real workers under a topic prefix unique to this run."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmstream import localstack
from mmstream.supervisor import Supervisor
from schemas.settings import Settings
from streams.runtime.parent import PARENT_PID_ENV
from streams.topics import ensure_topics, topic_specs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def infra() -> Settings:
    settings = Settings.from_env()
    before_k, before_r = localstack.status(settings, REPO)
    localstack.up(settings, REPO)
    yield settings
    if not before_k.running and not before_r.running:
        localstack.down(settings, REPO)


@dataclass
class Pipeline:
    settings: Settings
    env: dict[str, str]
    supervisor: Supervisor

    @property
    def bootstrap(self) -> str:
        return self.settings.kafka.bootstrap

    @property
    def prefix(self) -> str:
        return self.settings.kafka.topic_prefix


def start_pipeline(infra: Settings, replicas: dict[str, int], **extra_env: str) -> Pipeline:
    env = dict(os.environ)
    env["MMSTREAM_KAFKA_TOPIC_PREFIX"] = f"t{uuid.uuid4().hex[:10]}"
    env["MMSTREAM_KAFKA_PARTITIONS"] = "2"
    env["MMSTREAM_LOCAL_METRICS_BASE_PORT"] = "0"  # never collide with a developer's `mmstream up`
    env[PARENT_PID_ENV] = str(os.getpid())  # a test run killed midway leaves no workers behind
    env.update(extra_env)
    settings = Settings.from_env(env)
    asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka, settings.dlq)))
    sup = Supervisor(settings, env)
    sup.start(replicas)
    pipe = Pipeline(settings, env, sup)
    try:
        asyncio.run(wait_ready(pipe))
    except BaseException:
        logs = "\n".join(f"--- {w.log_file}\n" + Path(w.log_file).read_text()[-3000:] for w in sup.workers())
        sup.stop()
        raise RuntimeError(f"pipeline did not become ready\n{logs}")
    return pipe


async def wait_ready(pipe: Pipeline, timeout_s: float = 180.0) -> None:
    from streams.sdk.client import wait_until_serving

    await wait_until_serving(pipe.bootstrap, pipe.prefix, timeout_s)


@pytest.fixture(scope="session")
def pipeline(infra: Settings) -> Pipeline:
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1,
                                  "encode.video": 1, "lagmon": 1},
                          MMSTREAM_VIDEO_FRAMES_PER_CHUNK="2",  # several chunks per test clip
                          # These tests send bursts to test answers, not shedding (test_admission does).
                          MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT="60000",
                          # Audio runs in its own pipeline (test_audio_pipeline.py), so this one
                          # also shows how an undeployed modality is answered.
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image,video",
                          # A priority every user may set (lower), so test_priority_live reads the same as root or not.
                          MMSTREAM_LOCAL_NICE="lagmon=3")
    yield pipe
    pipe.supervisor.stop()


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now (a secured broker of a test's own listens on them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
