"""Infrastructure a chaos scenario owns, so its faults never reach anyone else's: its own
KRaft broker (or a three-node cluster), its own Redis, and a Toxiproxy in front of either.

Everything binds 127.0.0.1 on ports picked free at start, lives under the run's own folder
and is stopped (SIGKILL: it is all disposable) when the run ends. The shared broker on
127.0.0.1:9092 and the shared Redis on 6379 are never started, stopped or signalled here.

A broker behind the proxy advertises the proxy's port, so every client — workers and the
runner alike — reaches it only through the proxy, and a cut there is a cut for all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis as redis_sync

from mmstream.localstack import procs
from mmstream.localstack.kafka import (C1_ONLY, LocalKafka, _cluster_id, _require_java, failover_lines,
                                       metadata_round_trip)
from mmstream.localstack.redis import LocalRedis
from schemas.settings import Settings

TOXIPROXY_VERSION = "v2.12.0"
TOXIPROXY_HINT = ("toxiproxy-server is missing: `make chaos-tools` (or infra/chaos-tools.sh) builds it with "
                  f"`go install github.com/Shopify/toxiproxy/v2/cmd/server@{TOXIPROXY_VERSION}`")


FAST_START_JVM = (C1_ONLY, "-XX:+UseSerialGC")
"""A chaos broker is restarted under load and must answer soon: the C1 compiler only and the
serial collector start it faster on a small box (restart after kill -9 on the 2-core box,
nothing else of the run running: 6.1 s stock, 5.4 s with these; docs/reliability.md). Its
throughput at chaos traffic rates does not notice."""


class InfraError(RuntimeError):
    """A piece of a scenario's own infrastructure could not be started or found."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toxiproxy_binary(settings: Settings) -> str:
    """The toxiproxy server: on PATH, or where infra/chaos-tools.sh puts it."""
    for candidate in (shutil.which("toxiproxy-server"), settings.local.cache_dir / "bin" / "toxiproxy-server"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise InfraError(TOXIPROXY_HINT)


@dataclass
class Toxiproxy:
    """A toxiproxy server and its HTTP API (``/proxies``, ``/proxies/<name>/toxics``)."""

    binary: str
    root: Path
    api_port: int = field(default_factory=free_port)
    pid: int | None = None

    def start(self) -> None:
        self.pid = procs.start_detached([self.binary, "-host", "127.0.0.1", "-port", str(self.api_port)],
                                        self.root / "toxiproxy.log", self.root)
        _wait(lambda: procs.is_port_open("127.0.0.1", self.api_port), 15, "toxiproxy did not start")

    def add_proxy(self, name: str, listen_port: int, upstream: str) -> None:
        self._call("POST", "/proxies", {"name": name, "listen": f"127.0.0.1:{listen_port}", "upstream": upstream,
                                        "enabled": True})

    def enable(self, name: str, enabled: bool) -> None:
        """``enabled=False`` cuts the link: open connections close, new ones are refused."""
        self._call("POST", f"/proxies/{name}", {"enabled": enabled})

    def add_toxic(self, proxy: str, kind: str, attributes: dict[str, int], stream: str = "downstream") -> str:
        name = f"{kind}_{stream}"
        self._call("POST", f"/proxies/{proxy}/toxics", {"name": name, "type": kind, "stream": stream,
                                                         "toxicity": 1.0, "attributes": attributes})
        return name

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}", None)

    def _call(self, method: str, path: str, body: dict | None) -> None:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.api_port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:  # loopback only
            resp.read()

    def stop(self) -> None:
        _kill(self.pid)


@dataclass
class BrokerNode:
    node_id: int
    port: int
    controller_port: int
    advertised_port: int
    data_dir: Path
    props: Path
    log: Path
    pid: int | None = None


class OwnKafka:
    """One broker or a three-node KRaft cluster (every node broker and controller) of the run's own."""

    def __init__(self, settings: Settings, repo_root: Path, root: Path, nodes: int = 1,
                 proxied: bool = False, heap_mb: int = 384, class_archive: bool = True) -> None:
        self.settings = settings
        self.class_archive = class_archive
        """Start the JVMs from a class-data archive of the broker (see ``_archive_options``)."""
        self._jvm_archive: list[str] = []
        self._training_archive: Path | None = None
        """Set on the throwaway broker that writes the archive when it exits."""
        self.repo_root = repo_root
        self.root = root
        self.heap_mb = heap_mb
        self.cluster_id = _cluster_id()
        self.nodes: list[BrokerNode] = []
        for i in range(1, nodes + 1):
            port, controller = free_port(), free_port()
            advertised = free_port() if proxied else port
            d = root / f"kafka-{i}"
            self.nodes.append(BrokerNode(i, port, controller, advertised, d / "data", d / "server.properties",
                                         d / "broker.log"))
        self.replication = 3 if nodes >= 3 else 1

    @property
    def bootstrap(self) -> str:
        """What clients use: the advertised ports (the proxy's, when proxied)."""
        return ",".join(f"127.0.0.1:{n.advertised_port}" for n in self.nodes)

    def start(self, timeout_s: float = 120) -> None:
        java = _require_java()
        libs = LocalKafka(self.settings.local, "127.0.0.1:1", self.repo_root).ensure_jars()
        self._java, self._classpath = java, f"{libs}/*"
        if self.class_archive:
            self._jvm_archive = self._archive_options(libs)
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        rf, isr = self.replication, min(2, self.replication)
        for n in self.nodes:
            n.data_dir.mkdir(parents=True, exist_ok=True)
            n.props.write_text("\n".join([
                "process.roles=broker,controller", f"node.id={n.node_id}", f"controller.quorum.voters={voters}",
                f"listeners=PLAINTEXT://127.0.0.1:{n.port},CONTROLLER://127.0.0.1:{n.controller_port}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{n.advertised_port}",
                "controller.listener.names=CONTROLLER",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name=PLAINTEXT", f"log.dirs={n.data_dir}",
                f"offsets.topic.replication.factor={rf}", f"transaction.state.log.replication.factor={rf}",
                f"transaction.state.log.min.isr={isr}", f"default.replication.factor={rf}",
                f"min.insync.replicas={isr}", "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1", "auto.create.topics.enable=false",
                "group.initial.rebalance.delay.ms=0", "num.network.threads=2", "num.io.threads=2",
                # 32 MiB, not 128: the cleaner allocates it at start (infra/kafka/server.properties)
                "log.cleaner.dedupe.buffer.size=33554432",
                "unclean.leader.election.enable=false", ""]) + failover_lines())
            procs.run_tool([java, "-cp", self._classpath, "kafka.tools.StorageTool", "format", "-t",
                            self.cluster_id, "-c", str(n.props)], "Formatting a chaos broker", timeout_s=90)
        for n in self.nodes:
            self.start_node(n)
        self.wait_ready(timeout_s)

    def start_node(self, n: BrokerNode) -> None:
        """Start (or start again, on its data) one node."""
        log4j = f"-Dlog4j2.configurationFile={self.repo_root / 'infra' / 'kafka' / 'log4j2.xml'}"
        dump = self._training_archive
        archive = [f"-XX:ArchiveClassesAtExit={dump}"] if dump else self._jvm_archive
        n.pid = procs.start_detached([self._java, f"-Xmx{self.heap_mb}m", f"-Xms{self.heap_mb // 2}m",
                                      *FAST_START_JVM, *archive, "-XX:+ExitOnOutOfMemoryError", log4j,
                                      "-cp", self._classpath, "kafka.Kafka", str(n.props)], n.log, n.data_dir.parent)

    def _archive_options(self, libs: Path) -> list[str]:
        """JVM options that load the broker's classes from a dynamic class-data-sharing archive
        (JDK 13+), made once per machine, JDK and jar set under ``<cache_dir>/kafka-cds/`` by a
        throwaway broker stopped cleanly (the JVM writes the archive on a clean exit). A JVM
        that finds the archive unusable ignores it and starts as usual. Measured: a restart
        after kill -9 answers in 4.7 s instead of 5.4 s (docs/reliability.md). [] when the
        archive cannot be made."""
        jars = sorted(p.name for p in Path(libs).glob("*.jar"))
        java = os.path.realpath(self._java)  # the JDK and its build: an upgrade makes a new archive
        key = hashlib.sha256("\n".join([java, str(os.stat(java).st_mtime_ns), *jars]).encode()).hexdigest()[:16]
        archive = self.settings.local.cache_dir / "kafka-cds" / f"{key}.jsa"
        if not archive.is_file():
            archive.parent.mkdir(parents=True, exist_ok=True)
            training = OwnKafka(self.settings, self.repo_root, self.root / "cds-training", class_archive=False)
            training._training_archive = archive
            try:
                training.start()
                training.kill(training.nodes[0], signal.SIGTERM)
            except Exception:  # no archive: the broker starts the usual way
                training.stop()
                return []
            finally:
                shutil.rmtree(self.root / "cds-training", ignore_errors=True)
        return [f"-XX:SharedArchiveFile={archive}"] if archive.is_file() else []

    def wait_ready(self, timeout_s: float = 120) -> None:
        for n in self.nodes:
            _wait(lambda n=n: procs.is_port_open("127.0.0.1", n.port), timeout_s,
                  f"chaos broker {n.node_id} did not open its port; see {n.log}")
        _wait(lambda: metadata_round_trip(self.bootstrap, 5.0), timeout_s, "the chaos broker does not answer")

    def kill(self, n: BrokerNode, sig: int = signal.SIGKILL) -> None:
        """Signal one node and wait until it is gone (SIGTERM: a clean shutdown)."""
        if n.pid is None:
            return
        if sig == signal.SIGTERM:
            procs.terminate(n.pid, grace_s=60)
        else:
            _kill(n.pid)
        n.pid = None

    def stop(self) -> None:
        for n in self.nodes:
            _kill(n.pid)
            n.pid = None


class OwnRedis:
    """A Redis of the run's own (the localstack launcher, under the run's state folder)."""

    def __init__(self, settings: Settings, repo_root: Path, root: Path, maxmemory_mb: int = 64) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        local = settings.local.model_copy(update={"state_dir": root, "redis_maxmemory_mb": maxmemory_mb})
        self.server = LocalRedis(local, self.url, template=repo_root / "infra" / "redis" / "redis.conf")

    def start(self) -> None:
        status = self.server.start()
        if status.external:
            raise InfraError(f"port {self.port} was taken by another Redis")

    def kill(self) -> None:
        record = procs.read_pid_file(self.server.pid_file)
        if record is not None:
            _kill(record.pid)
            self.server.pid_file.unlink(missing_ok=True)

    def evict_all(self) -> int:
        """Drop every key (what eviction does to claim checks and cache entries in flight)."""
        client = redis_sync.Redis.from_url(self.url, socket_timeout=5)
        try:
            n = int(client.dbsize())
            client.flushall()
            return n
        finally:
            client.close()

    def stop(self) -> None:
        self.kill()


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while procs.is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs._reap(pid)  # noqa: SLF001 - our own child


def _wait(ready, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() >= deadline:
            raise InfraError(message)
        time.sleep(0.3)
