"""A local Redis for `mmstream up` and the integration tests: the reuse cache, nothing durable.

Configured from infra/redis/redis.conf (loopback only, a memory cap with LRU eviction, no
persistence). Its state lives under ``<state_dir>/redis``: ``redis.json`` (pid file),
``redis.conf`` (the filled template) and ``redis.log`` (``state_name``: ``redis-secure`` for the
secured one of `mmstream up --secure`, which runs beside the plain one on its own port).

Secured when the URLs say so: a password in the workers' or the clients' URL turns on ACL
users (``users.acl``, from ``mmstream.localstack.redis_acl``; the default user off), plus
``mmadmin`` for this module's own management (its password in ``admin.secret``, mode 0600);
``add_client_user`` adds one tenant's claim-check user. A ``rediss://`` URL makes the server
listen with TLS only, on a certificate signed by a CA generated under ``tls/`` (clients
trust ``tls/ca.crt``: point ``MMSTREAM_REDIS_TLS_CA`` at it). No password is printed or
logged; a status never shows the URL's password.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template
from urllib.parse import quote, urlsplit

import redis

from mmstream.localstack import procs, redis_acl
from mmstream.localstack.procs import LocalStackError
from schemas.request import TENANT_RE, claim_prefix
from schemas.settings import LocalSettings, redact
from workers.redisconn import connect

_TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "redis" / "redis.conf"
_HINT = "Redis is needed for the local cache: sudo apt-get install redis-server"


@dataclass(frozen=True)
class RedisStatus:
    """What `mmstream status` shows about Redis."""

    running: bool  # a server answers on the URL's port (or, if ours, its process lives)
    pid: int | None  # our server's pid; None when not running or external
    url: str  # its password masked
    healthy: bool  # answered PING just now
    external: bool  # a server we did not start (never stopped by us)
    used_memory_bytes: int | None
    maxmemory_bytes: int | None  # 0 means no cap
    maxmemory_policy: str | None
    log_file: Path | None  # our server's log


class LocalRedis:
    """Start, stop and inspect the local Redis that ``url`` points at.

    ``template`` defaults to infra/redis/redis.conf of this checkout.
    """

    def __init__(self, local: LocalSettings, url: str, template: Path = _TEMPLATE,
                 probe_timeout_s: float = 2.0, client_url: str = "", tls_ca: str = "",
                 state_name: str = "redis") -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise LocalStackError(f"Redis URL {redact(url)!r} is not redis://host:port/db.")
        self.local = local
        self.url = url
        self.client_url = client_url
        self.tls = parts.scheme == "rediss"
        self.host = parts.hostname
        self.port = parts.port or 6379
        self.template = template
        self.root = local.state_dir / state_name
        self.pid_file = self.root / "redis.json"
        self.conf = self.root / "redis.conf"
        self.log_file = self.root / "redis.log"
        self.acl_file = self.root / "users.acl"
        self.admin_secret = self.root / "admin.secret"
        self.tls_dir = self.root / "tls"
        self.tls_ca = tls_ca or str(self.tls_dir / "ca.crt")
        self.probe_timeout_s = probe_timeout_s
        try:
            self.secured = bool(redis_acl.users(url, client_url))
        except ValueError as exc:
            raise LocalStackError(f"Redis users: {exc}") from None

    def ensure_installed(self) -> str:
        """The path of redis-server, installed with apt-get when missing and we are root.

        Raises LocalStackError saying how to install it when that is not possible.
        """
        found = shutil.which("redis-server")
        if found:
            return found
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise LocalStackError(_HINT)
        install = ["apt-get", "install", "-y", "-q", "redis-server"]
        try:
            procs.run_tool(install, "Installing redis-server", timeout_s=600)
        except LocalStackError:
            # Usually a stale or empty package index (fresh containers ship none).
            procs.run_tool(["apt-get", "update", "-q"], "Updating the apt package index", timeout_s=600)
            procs.run_tool(install, "Installing redis-server", timeout_s=600)
        return procs.require_tool("redis-server", _HINT)

    def start(self, timeout_s: float = 15) -> RedisStatus:
        """Make a Redis answer PING at the URL and return its status.

        Idempotent: our server already running is reused; a server someone else runs on
        the port is reused and reported ``external``. Raises LocalStackError, with the last
        20 log lines, if ours exits or does not answer within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with procs.state_lock(self.root / "start.lock"):
            record = procs.read_pid_file(self.pid_file)
            if record is None or not record.is_running():
                if self._ping():
                    return self.status()
                self._check_port_free()
                record = self._launch(self.ensure_installed())
            try:
                self._wait_ready(record, deadline)
            except LocalStackError:
                procs.terminate(record.pid, grace_s=5, started=record.started)
                self.pid_file.unlink(missing_ok=True)
                raise
        return self.status()

    def stop(self, grace_s: float = 10) -> RedisStatus:
        """Stop our server (SIGTERM, then SIGKILL after ``grace_s``); an external one is left alone."""
        procs.stop_recorded(self.pid_file, self.root / "start.lock", grace_s)
        return self.status()

    def status(self) -> RedisStatus:
        """Our server's state if it runs, else whether some other server answers at the URL."""
        record = procs.read_pid_file(self.pid_file)
        ours = record is not None and record.is_running()
        memory = self._memory_info()
        healthy = memory is not None
        memory = memory or {}
        return RedisStatus(
            running=ours or healthy,
            pid=record.pid if ours and record else None,
            url=redact(self.url),
            healthy=healthy,
            external=healthy and not ours,
            used_memory_bytes=memory.get("used_memory"),
            maxmemory_bytes=memory.get("maxmemory"),
            maxmemory_policy=memory.get("maxmemory_policy"),
            log_file=self.log_file if ours else None,
        )

    # -- internals -------------------------------------------------------------------------

    def _check_port_free(self) -> None:
        if procs.is_port_open(self.host, self.port):
            raise LocalStackError(
                f"Port {self.port} on {self.host} is taken by something that does not answer Redis "
                "PING; free it or set MMSTREAM_REDIS_URL to another port.")
        if not procs.is_loopback(self.host):
            raise LocalStackError(
                f"No Redis answers at {self.url}, and `mmstream up` only starts one on this "
                "machine's loopback address (127.0.0.1 or localhost).")

    def _launch(self, server: str) -> procs.PidRecord:
        self.root.mkdir(parents=True, exist_ok=True)
        security: list[str] = []
        if self.secured:
            entries = redis_acl.users(self.url, self.client_url, self._admin_password())
            kept = self._extra_users()
            procs.write_private(self.acl_file, redis_acl.acl_file(entries, kept))
            security.append(f'aclfile "{self.acl_file}"')
        if self.tls:
            self._ensure_certificate()
            security += [f"tls-port {self.port}", f'tls-cert-file "{self.tls_dir / "server.crt"}"',
                         f'tls-key-file "{self.tls_dir / "server.key"}"', f'tls-ca-cert-file "{self.tls_dir / "ca.crt"}"',
                         "tls-auth-clients no"]
        self.conf.write_text(Template(self.template.read_text()).substitute(
            host=self.host, port=0 if self.tls else self.port, dir=self.root, logfile=self.log_file,
            maxmemory_mb=self.local.redis_maxmemory_mb, security="\n".join(security)))
        self.log_file.write_bytes(b"")  # so a failure's tail shows this run, not the last
        pid = procs.start_detached([server, str(self.conf)], self.log_file, cwd=self.root,
                                   nice=self.local.nice_of("redis"))
        return procs.write_pid_file(self.pid_file, pid, url=self.url)

    def _wait_ready(self, record: procs.PidRecord, deadline: float) -> None:
        while True:
            if not record.is_running():
                raise LocalStackError(f"redis-server exited while starting; {self.log_file} ends with:\n"
                                      + procs.tail(self.log_file))
            if self._ping():
                return
            if time.monotonic() >= deadline:
                raise LocalStackError(f"redis-server did not answer PING in time; {self.log_file} "
                                      "ends with:\n" + procs.tail(self.log_file))
            time.sleep(0.05)

    def _client(self) -> redis.Redis:
        return connect(self.url, self.tls_ca if self.tls else None, socket_connect_timeout=self.probe_timeout_s,
                       socket_timeout=self.probe_timeout_s)

    # -- users and certificates -------------------------------------------------------------

    def add_client_user(self, name: str, password: str, tenant: str) -> None:
        """Give tenant ``tenant`` a Redis user ``name`` that may only SET and GET its own
        claim checks (``mm:claim:<tenant>:*``), on the running server and in ``users.acl``
        (kept across restarts of this server). What `mmstream tenant add` calls when the
        local Redis is secured. Raises LocalStackError when it is not secured or not ours."""
        if not self.secured:
            raise LocalStackError("the local Redis has no users: put a password in MMSTREAM_REDIS_URL first")
        if not TENANT_RE.fullmatch(tenant):
            raise LocalStackError(f"{tenant!r} is not a tenant name")
        user = redis_acl.AclUser(name, password, redis_acl.client_rule(claim_prefix(tenant)))
        lines = [ln for ln in self._extra_users() if not ln.startswith(f"user {name} ")] + [user.line()]
        self.root.mkdir(parents=True, exist_ok=True)
        procs.write_private(self.root / "tenants.acl", "\n".join(lines) + "\n")
        entries = redis_acl.users(self.url, self.client_url, self._admin_password())
        procs.write_private(self.acl_file, redis_acl.acl_file(entries, lines))
        admin = connect(self._admin_url(), self.tls_ca if self.tls else None, socket_timeout=self.probe_timeout_s,
                        socket_connect_timeout=self.probe_timeout_s)
        try:
            admin.execute_command("ACL", "LOAD")
        except (redis.RedisError, OSError) as exc:
            raise LocalStackError(f"could not reload the Redis users ({exc.__class__.__name__})") from None
        finally:
            admin.close()

    def _extra_users(self) -> list[str]:
        path = self.root / "tenants.acl"
        return [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []

    def _admin_password(self) -> str:
        return procs.kept_secret(self.admin_secret)

    def user_url(self, name: str, password: str) -> str:
        """The URL that connects to this server as user ``name``."""
        return f"{'rediss' if self.tls else 'redis'}://{name}:{quote(password, safe='')}@{self.host}:{self.port}/0"

    def _admin_url(self) -> str:
        return self.user_url("mmadmin", self._admin_password())

    def _ensure_certificate(self) -> None:
        """A CA and a server certificate for ``host`` under ``tls/`` (made once, with openssl)."""
        d = self.tls_dir
        if (d / "server.crt").exists() and (d / "server.key").exists() and (d / "ca.crt").exists():
            return
        d.mkdir(parents=True, exist_ok=True)
        openssl = procs.require_tool("openssl", "openssl makes the local TLS certificates: apt-get install openssl")
        san = f"IP:{self.host}" if self.host.replace(".", "").isdigit() else f"DNS:{self.host}"
        (d / "san.ext").write_text(f"subjectAltName={san},DNS:localhost,IP:127.0.0.1\n")
        steps = [
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "825", "-subj", "/CN=mmstream local CA",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt")],
            [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={self.host}",
             "-keyout", str(d / "server.key"), "-out", str(d / "server.csr")],
            [openssl, "x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-days", "825", "-extfile", str(d / "san.ext"), "-out", str(d / "server.crt")],
        ]
        for argv in steps:
            procs.run_tool(argv, "Making the local Redis TLS certificate", timeout_s=60)
        for key in ("ca.key", "server.key"):
            os.chmod(d / key, 0o600)

    def _ping(self) -> bool:
        return self._memory_info() is not None

    def _memory_info(self) -> dict | None:
        """INFO memory of the server at the URL, or None if it does not answer as Redis."""
        if not procs.is_port_open(self.host, self.port):
            return None
        client = self._client()
        try:
            client.ping()
            return client.info("memory")
        except (redis.RedisError, OSError):
            return None
        finally:
            client.close()
