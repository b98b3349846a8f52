"""The local infrastructure behind `mmstream up | down | status`: a KRaft broker and Redis.

Both run as detached processes on loopback, with pid files, configs and logs under
``settings.local.state_dir``. Every call is idempotent, and a server we did not start is
used but never stopped.
"""

from __future__ import annotations

from pathlib import Path

from mmstream.localstack.kafka import KafkaStatus, LocalKafka
from mmstream.localstack.procs import LocalStackError
from mmstream.localstack.redis import LocalRedis, RedisStatus
from schemas.settings import Settings

__all__ = ["KafkaStatus", "LocalKafka", "LocalRedis", "LocalStackError", "RedisStatus",
           "down", "status", "up"]


def up(settings: Settings, repo_root: Path, timeout_s: float = 90) -> tuple[KafkaStatus, RedisStatus]:
    """Start (or reuse) the broker, then Redis; return both statuses once they answer.

    Raises LocalStackError with one actionable message (and a log tail where there is one).
    A broker started before a Redis failure keeps running; calling `up` again reuses it.
    """
    kafka = _kafka(settings, repo_root).start(timeout_s=timeout_s)
    cache = _redis(settings, repo_root).start()
    return kafka, cache


def down(settings: Settings, repo_root: Path, grace_s: float = 60) -> tuple[KafkaStatus, RedisStatus]:
    """Stop the broker and Redis that `up` started; return their statuses afterwards.

    Servers we did not start stay up and are reported ``external``.
    """
    cache = _redis(settings, repo_root).stop()
    kafka = _kafka(settings, repo_root).stop(grace_s=grace_s)
    return kafka, cache


def status(settings: Settings, repo_root: Path) -> tuple[KafkaStatus, RedisStatus]:
    """The broker's and Redis's current statuses; starts and stops nothing."""
    return _kafka(settings, repo_root).status(), _redis(settings, repo_root).status()


def _kafka(settings: Settings, repo_root: Path) -> LocalKafka:
    return LocalKafka(settings.local, settings.kafka.bootstrap, repo_root)


def _redis(settings: Settings, repo_root: Path) -> LocalRedis:
    return LocalRedis(settings.local, settings.redis.url, template=repo_root / "infra" / "redis" / "redis.conf",
                      client_url=settings.redis.client_url, tls_ca=settings.redis.tls_ca)
