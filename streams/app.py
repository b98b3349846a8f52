"""The Faust app factory. Nothing happens at import time: a stage builds its app, installs
its record loop on it (``streams.runtime.stage.RecordStage``), and the worker runs it.

Faust hosts every worker — the app, ``faust.Worker``'s lifecycle and signal handling, timers,
logging — while the stages read and write Kafka through their own aiokafka clients
(``streams.runtime.io`` says why). So the app starts without Faust's own consumer,
producer, web server and sensors (its ``BootStrategy``).

Every app reports into a ``WorkerHealth`` (the process's unless one is given): ready once
Faust has fully started it (the stage's clients started, engines loaded before that) and
while it is neither stopping nor crashed, live unless it crashed. The records it holds
(taken, not yet finished) are the stage's to report (``RecordStage``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import faust
from faust.app.base import BootStrategy
from faust.auth import OAuthCredentials, SASLCredentials, SSLCredentials

from schemas.settings import Settings
from schemas.topics import TopicNames
from streams.connection import FileTokenProvider, KafkaSecurity
from streams.observe.health import WorkerHealth, process_health



def group_id(topic_prefix: str, stage: str) -> str:
    """The consumer group (and Faust app id) of ``stage``: ``<prefix>-<stage>``, dots as dashes."""
    return f"{topic_prefix}-{stage.replace('.', '-')}"


def stage_datadir(settings: Settings, stage: str, replica: int = 0) -> Path:
    """Where one replica of a stage keeps its local state (Faust's datadir, the retrieve
    stage's snapshots)."""
    return settings.local.state_dir / "faust" / settings.kafka.topic_prefix / f"{stage}-{replica}"


def create_app(settings: Settings, stage: str, replica: int = 0, health: WorkerHealth | None = None) -> faust.App:
    """A Faust app whose id (and so consumer group) is ``<prefix>-<stage>``.

    Every replica of a stage uses the same id, so Kafka spreads the stage's partitions over
    them. Faust's web server is off: each worker serves Prometheus metrics on its own port.
    """
    k = settings.kafka
    datadir = stage_datadir(settings, stage, replica)
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        group_id(k.topic_prefix, stage),
        broker=[f"kafka://{server.strip()}" for server in k.bootstrap.split(",")],
        web_enabled=False,
        datadir=str(datadir),
        topic_partitions=k.partitions,
        topic_replication_factor=k.replication_factor,
        topic_disable_leader=True,
        table_standby_replicas=0,
        producer_max_request_size=k.max_message_bytes,
        consumer_max_fetch_size=k.max_message_bytes,
        # Faust's own consumer is off (the stages' StageIO clients carry the group sessions);
        # should it still open one, it uses the stages' session and heartbeat.
        broker_session_timeout=k.session_timeout_ms / 1000.0,
        broker_heartbeat_interval=min(k.heartbeat_interval_ms, k.session_timeout_ms // 3) / 1000.0,
        broker_commit_interval=0.5,
        producer_linger_ms=1,
        # Raw bytes in and out: our code decodes, so a poison message is ours to handle.
        key_serializer="raw",
        value_serializer="raw",
        logging_config=None,
        # Faust's own clients are off (BootStrategy below); should it still open one, it
        # authenticates as the pipeline's service principal like every other client.
        broker_credentials=faust_credentials(KafkaSecurity.from_settings(k)),
    )
    app.boot_strategy = BootStrategy(app, enable_kafka_consumer=False, enable_kafka_producer=False,
                                     enable_web=False, enable_sensors=False)
    watch_health(app, stage, process_health() if health is None else health)
    return app


def watch_health(app: faust.App, stage: str, health: WorkerHealth) -> None:
    """Report ``app``'s readiness and liveness into ``health``."""
    running = threading.Event()  # set on the loop, read by the metrics server's thread

    @app.task
    async def report_health() -> None:  # tasks start once the app is fully started
        running.set()
        health.mark("ready")

    health.stage = stage
    health.require(f"faust:{stage}", ready=lambda: running.is_set() and not app.should_stop and not app.crashed,
                   live=lambda: not app.crashed)


def topic_names(settings: Settings) -> TopicNames:
    return TopicNames(settings.kafka.topic_prefix)


def faust_credentials(security: KafkaSecurity) -> Any:
    """Faust's ``broker_credentials`` for ``security`` (None for PLAINTEXT)."""
    if security.protocol == "PLAINTEXT":
        return None
    if not security.sasl:
        return SSLCredentials(security.ssl_context())
    if security.mechanism == "OAUTHBEARER":
        return OAuthCredentials(oauth_cb=FileTokenProvider(security.oauth_token_file),
                                ssl_context=security.ssl_context())
    return SASLCredentials(username=security.username, password=security.password,
                           ssl_context=security.ssl_context(), mechanism=security.mechanism)
