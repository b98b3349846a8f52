"""The local infrastructure behind `mmstream up | down | status`: a KRaft broker and Redis.

Both run as detached processes on loopback, with pid files, configs and logs under
``settings.local.state_dir``. Every call is idempotent, and a server we did not start is
used but never stopped. ``up(..., secure=True)`` starts the secured broker
(``secure.SecureKafka``: SASL_SSL, ACLs, its own ports) instead of the plaintext one;
``down`` stops whichever of ours runs.
"""

from __future__ import annotations

from pathlib import Path

from mmstream.localstack.kafka import KafkaStatus, LocalKafka
from mmstream.localstack.procs import LocalStackError
from mmstream.localstack.redis import LocalRedis, RedisStatus
from mmstream.localstack.secure import SecureKafka
from schemas.settings import Settings

__all__ = ["KafkaStatus", "LocalKafka", "LocalRedis", "LocalStackError", "RedisStatus", "SecureKafka",
           "down", "secure_kafka", "status", "up"]


def up(settings: Settings, repo_root: Path, timeout_s: float = 90, secure: bool = False) -> tuple[KafkaStatus, RedisStatus]:
    """Start (or reuse) the broker (the secured one with ``secure``), then Redis; return
    both statuses once they answer.

    Raises LocalStackError with one actionable message (and a log tail where there is one).
    A broker started before a Redis failure keeps running; calling `up` again reuses it.
    """
    broker = secure_kafka(settings, repo_root) if secure else _kafka(settings, repo_root)
    kafka = broker.start(timeout_s=timeout_s)
    cache = _redis(settings, repo_root).start()
    return kafka, cache


def down(settings: Settings, repo_root: Path, grace_s: float = 60) -> tuple[KafkaStatus, RedisStatus]:
    """Stop the broker and Redis that `up` started; return their statuses afterwards.

    Servers we did not start stay up and are reported ``external``.
    """
    cache = _redis(settings, repo_root).stop()
    secure_kafka(settings, repo_root).stop(grace_s=grace_s)
    kafka = _kafka(settings, repo_root).stop(grace_s=grace_s)
    return kafka, cache


def status(settings: Settings, repo_root: Path) -> tuple[KafkaStatus, RedisStatus]:
    """The broker's and Redis's current statuses; starts and stops nothing."""
    return _kafka(settings, repo_root).status(), _redis(settings, repo_root).status()


def secure_kafka(settings: Settings, repo_root: Path) -> SecureKafka:
    """The secured local broker of these settings (started or not)."""
    return SecureKafka(settings.local, repo_root)


def _kafka(settings: Settings, repo_root: Path) -> LocalKafka:
    """The local broker the settings point at: the secured one when they name its port
    (a shell that sourced its mmstream.env), else the plaintext one."""
    secure = secure_kafka(settings, repo_root)
    if settings.kafka.authenticated and settings.kafka.bootstrap == secure.bootstrap:
        return secure
    return LocalKafka(settings.local, settings.kafka.bootstrap, repo_root)


def _redis(settings: Settings, repo_root: Path) -> LocalRedis:
    return LocalRedis(settings.local, settings.redis.url, template=repo_root / "infra" / "redis" / "redis.conf",
                      client_url=settings.redis.client_url, tls_ca=settings.redis.tls_ca)
