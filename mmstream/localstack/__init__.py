"""The local infrastructure behind `mmstream up | down | status`: a KRaft broker and Redis.

Both run as detached processes on loopback, with pid files, configs and logs under
``settings.local.state_dir``. Every call is idempotent, and a server we did not start is
used but never stopped. ``up(..., secure=True)`` starts the secured broker
(``secure.SecureKafka``: SASL_SSL, ACLs, its own ports) instead of the plaintext one;
``down`` stops whichever of ours runs. A secure ``up`` starts a secured Redis too
(``secure_redis``: ACL users, the default user off, its own port and state), so that a tenant's
Redis user (``LocalRedis.add_client_user``, from `mmstream tenant add`) reaches its own claim
checks only; ``secure_env`` is what its workers and clients are configured with.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from mmstream.localstack.kafka import KafkaStatus, LocalKafka
from mmstream.localstack import procs
from mmstream.localstack.procs import LocalStackError
from mmstream.localstack.redis import LocalRedis, RedisStatus
from mmstream.localstack.secure import SecureKafka
from schemas.settings import Settings

__all__ = ["KafkaStatus", "LocalKafka", "LocalRedis", "LocalStackError", "RedisStatus", "SecureKafka",
           "down", "redis_for", "secure_env", "secure_kafka", "secure_redis", "status", "up", "write_secure_env"]

SECURE_REDIS_STATE = "redis-secure"
"""The secured Redis's state directory under ``state_dir``."""


def up(settings: Settings, repo_root: Path, timeout_s: float = 90, secure: bool = False) -> tuple[KafkaStatus, RedisStatus]:
    """Start (or reuse) the broker (the secured one with ``secure``), then Redis; return
    both statuses once they answer.

    Raises LocalStackError with one actionable message (and a log tail where there is one).
    A broker started before a Redis failure keeps running; calling `up` again reuses it.
    """
    broker = secure_kafka(settings, repo_root) if secure else _kafka(settings, repo_root)
    kafka = broker.start(timeout_s=timeout_s)
    cache = (secure_redis(settings, repo_root) if secure else redis_for(settings, repo_root)).start()
    return kafka, cache


def down(settings: Settings, repo_root: Path, grace_s: float = 60) -> tuple[KafkaStatus, RedisStatus]:
    """Stop the broker and Redis that `up` started; return their statuses afterwards.

    Servers we did not start stay up and are reported ``external``.
    """
    cache = redis_for(settings, repo_root).stop()
    for state in ("redis", SECURE_REDIS_STATE):  # both of ours, whichever the shell's settings name
        _redis_state(settings, repo_root, state).stop()
    secure_kafka(settings, repo_root).stop(grace_s=grace_s)
    kafka = _kafka(settings, repo_root).stop(grace_s=grace_s)
    return kafka, cache


def status(settings: Settings, repo_root: Path) -> tuple[KafkaStatus, RedisStatus]:
    """The broker's and Redis's current statuses; starts and stops nothing."""
    return _kafka(settings, repo_root).status(), redis_for(settings, repo_root).status()


def secure_kafka(settings: Settings, repo_root: Path) -> SecureKafka:
    """The secured local broker of these settings (started or not)."""
    return SecureKafka(settings.local, repo_root)


def secure_redis(settings: Settings, repo_root: Path) -> LocalRedis:
    """The secured local Redis of `mmstream up --secure` (started or not): loopback, its own
    port (``redis_secure_port``) and state (``<state_dir>/redis-secure``), the workers' user
    ``mmworker`` with a password made once and kept there (``worker.secret``, mode 0600)."""
    root = settings.local.state_dir / SECURE_REDIS_STATE
    password = procs.kept_secret(root / "worker.secret")
    url = f"redis://mmworker:{password}@127.0.0.1:{settings.local.redis_secure_port}/0"
    return _local_redis(settings, repo_root, url, state_name=SECURE_REDIS_STATE)


def secure_env(settings: Settings, repo_root: Path) -> dict[str, str]:
    """The settings of a worker or operator's client of `mmstream up --secure`: the secure
    broker as the service principal and the secured Redis as the workers' user."""
    return {**secure_kafka(settings, repo_root).env(), "MMSTREAM_REDIS_URL": secure_redis(settings, repo_root).url}


def write_secure_env(settings: Settings, repo_root: Path) -> Path:
    """``<state_dir>/kafka-secure/mmstream.env`` (mode 0600): ``secure_env`` as lines a shell
    can source (``set -a; . FILE; set +a``)."""
    path = secure_kafka(settings, repo_root).root / "mmstream.env"
    path.parent.mkdir(parents=True, exist_ok=True)
    procs.write_private(path, "".join(f"{k}={v}\n" for k, v in secure_env(settings, repo_root).items()))
    return path


def _kafka(settings: Settings, repo_root: Path) -> LocalKafka:
    """The local broker the settings point at: the secured one when they name its port
    (a shell that sourced its mmstream.env), else the plaintext one."""
    secure = secure_kafka(settings, repo_root)
    if settings.kafka.authenticated and settings.kafka.bootstrap == secure.bootstrap:
        return secure
    return LocalKafka(settings.local, settings.kafka.bootstrap, repo_root)


def redis_for(settings: Settings, repo_root: Path) -> LocalRedis:
    """The local Redis the settings point at: the secured one when they name its port (a
    shell that sourced mmstream.env), else the plain one."""
    state = SECURE_REDIS_STATE if urlsplit(settings.redis.url).port == settings.local.redis_secure_port else "redis"
    return _local_redis(settings, repo_root, settings.redis.url, state_name=state)


def _redis_state(settings: Settings, repo_root: Path, state: str) -> LocalRedis:
    """One of our Redis servers as far as stopping it goes (its pid file; no password needed)."""
    return _local_redis(settings, repo_root, "redis://127.0.0.1:6379/0", state_name=state)


def _local_redis(settings: Settings, repo_root: Path, url: str, state_name: str) -> LocalRedis:
    return LocalRedis(settings.local, url, template=repo_root / "infra" / "redis" / "redis.conf",
                      client_url=settings.redis.client_url, tls_ca=settings.redis.tls_ca, state_name=state_name)
