"""The Faust app factory. Nothing happens at import time: a stage builds its app, installs
its agents on it, and the worker runs it."""

from __future__ import annotations

from typing import Any

import faust

from schemas.settings import Settings
from streams.topics import TopicNames


def create_app(settings: Settings, stage: str, replica: int = 0) -> faust.App:
    """A Faust app whose id (and so consumer group) is ``<prefix>-<stage>``.

    Every replica of a stage uses the same id, so Kafka spreads the stage's partitions over
    them. Faust's web server is off: each worker serves Prometheus metrics on its own port.
    """
    k = settings.kafka
    datadir = settings.local.state_dir / "faust" / k.topic_prefix / f"{stage}-{replica}"
    datadir.parent.mkdir(parents=True, exist_ok=True)
    return faust.App(
        f"{k.topic_prefix}-{stage.replace('.', '-')}",
        broker=[f"kafka://{server.strip()}" for server in k.bootstrap.split(",")],
        web_enabled=False,
        datadir=str(datadir),
        topic_partitions=k.partitions,
        topic_replication_factor=k.replication_factor,
        topic_disable_leader=True,
        table_standby_replicas=0,
        producer_max_request_size=k.max_message_bytes,
        consumer_max_fetch_size=k.max_message_bytes,
        # Engine calls run in an executor, so the loop keeps heartbeating; these bound how
        # long a stuck worker holds its partitions.
        broker_session_timeout=30.0,
        broker_heartbeat_interval=3.0,
        broker_commit_interval=0.5,
        producer_linger_ms=1,
        # Raw bytes in and out: our code decodes, so a poison message is ours to handle.
        key_serializer="raw",
        value_serializer="raw",
        logging_config=None,
    )


def raw_topic(app: faust.App, *names: str) -> Any:
    """A topic (or several, consumed as one stream) of raw bytes keys and values."""
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def topic_names(settings: Settings) -> TopicNames:
    return TopicNames(settings.kafka.topic_prefix)
