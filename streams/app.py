"""The Faust app factory. Nothing happens at import time: a stage builds its app, installs
its agents on it, and the worker runs it.

Every app reports into a ``WorkerHealth`` (the process's unless one is given): ready once
Faust has fully started it (tables recovered, agents running; engines load before that)
and while it is neither stopping nor crashed, live unless it crashed, and the number of
records it holds (consumed, not yet acknowledged), counted once a second for
``mmstream_inflight``.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import faust

from schemas.settings import Settings
from streams.health import WorkerHealth, process_health
from streams.topics import TopicNames

INFLIGHT_EVERY_S = 1.0


def create_app(settings: Settings, stage: str, replica: int = 0, health: WorkerHealth | None = None) -> faust.App:
    """A Faust app whose id (and so consumer group) is ``<prefix>-<stage>``.

    Every replica of a stage uses the same id, so Kafka spreads the stage's partitions over
    them. Faust's web server is off: each worker serves Prometheus metrics on its own port.
    """
    k = settings.kafka
    datadir = settings.local.state_dir / "faust" / k.topic_prefix / f"{stage}-{replica}"
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
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
    watch_health(app, stage, process_health() if health is None else health)
    return app


class _HeldRecords(faust.Sensor):
    """Remembers each record handed to a stream; those not yet acknowledged are in flight.

    Stages acknowledge records themselves (``event.ack()``, after their outputs are sent),
    which skips the sensor's ``on_message_out``: the count reads ``Message.acked`` instead."""

    def __init__(self) -> None:
        super().__init__()
        self.records: weakref.WeakSet = weakref.WeakSet()

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        self.records.add(message)

    def held(self) -> int | None:
        """Records handed in and not acknowledged; None if the set changed while counting
        (then the caller keeps the last count and tries again on its next round)."""
        try:
            done = [m for m in self.records if m.acked]
        except RuntimeError:  # "set changed size during iteration"
            return None
        for m in done:
            self.records.discard(m)
        return len(self.records)


def watch_health(app: faust.App, stage: str, health: WorkerHealth) -> None:
    """Report ``app``'s readiness, liveness and in-flight records into ``health``."""
    sensor = _HeldRecords()
    app.sensors.add(sensor)
    running = threading.Event()  # set on the loop, read by the metrics server's thread

    @app.task
    async def report_health() -> None:  # tasks start once the app is fully started
        running.set()
        while True:
            held = sensor.held()
            if held is not None:
                health.set_inflight(stage, held)
            await asyncio.sleep(INFLIGHT_EVERY_S)

    health.stage = stage
    health.require(f"faust:{stage}", ready=lambda: running.is_set() and not app.should_stop and not app.crashed,
                   live=lambda: not app.crashed)


def raw_topic(app: faust.App, *names: str) -> Any:
    """A topic (or several, consumed as one stream) of raw bytes keys and values."""
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def topic_names(settings: Settings) -> TopicNames:
    return TopicNames(settings.kafka.topic_prefix)
