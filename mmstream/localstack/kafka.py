"""A single-node KRaft Kafka broker for `mmstream up` and the integration tests.

The broker is assembled from Maven Central jars (infra/kafka/pom.xml), configured from
infra/kafka/server.properties, and run as a detached JVM. Its state lives under
``<state_dir>/kafka``: ``broker.json`` (pid file) and one ``<run-id>/`` directory per start
holding ``server.properties``, the data (``data/``) and the log (``broker.log``). A fresh
data directory per run keeps a crashed run's half-written logs from breaking the next.

``LocalKafka`` is the plaintext broker; ``mmstream.localstack.secure.SecureKafka`` a secured
one beside it (its own ports and state), through the hooks ``_template_values``,
``_format_args``, ``_other_ports`` and ``client_kwargs``.
"""

from __future__ import annotations

import asyncio
import base64
import re
import secrets
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from mmstream.localstack import procs
from mmstream.localstack.procs import LocalStackError
from schemas.settings import LocalSettings

NODE_ID = 1
FAILOVER_PROPERTIES = {
    # Classic consumer groups may ask for sessions from 1 s (stock minimum: 6 s), so the
    # pipeline's stages can be sized to move a dead replica's partitions in seconds.
    "group.min.session.timeout.ms": "1000",
    # The controller fences a broker that stopped heartbeating after 2 s (stock: 9 s; four
    # missed heartbeats), which moves its partitions' leadership and drops it from their
    # ISRs: in a cluster, a leader killed under load costs clients this long (counted from a
    # new controller's activation when the dead node was also the active controller) plus a
    # metadata refresh. Measured in the cluster chaos scenario: leaders moved 5.0 s after the
    # kill at 3000 (1.7 s controller election + 3.3 s).
    "broker.session.timeout.ms": "2000",
    "broker.heartbeat.interval.ms": "500",
    # A controller quorum that lost its leader elects another within about a second.
    "controller.quorum.fetch.timeout.ms": "1000",
    "controller.quorum.election.timeout.ms": "500",
}
"""Broker settings for fast failover (docs/reliability.md, "Failover: where the seconds go"),
appended to every local and chaos broker's server.properties."""
_RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")
_JAVA_HINT = "Java 17+ is needed to run the local Kafka broker: apt-get install openjdk-17-jre-headless"
_MVN_HINT = ("Maven is needed once to fetch the Kafka broker jars from Maven Central: "
             "apt-get install maven")


@dataclass(frozen=True)
class KafkaStatus:
    """What `mmstream status` shows about the broker."""

    running: bool  # a broker answers on (or, if ours, was started for) ``bootstrap``
    pid: int | None  # our broker's pid; None when not running or external
    bootstrap: str  # host:port clients connect to
    healthy: bool  # answered a metadata request just now
    external: bool  # served by a broker we did not start (never stopped by us)
    data_dir: Path | None  # our broker's log.dirs
    log_file: Path | None  # our broker's stdout+stderr


class LocalKafka:
    """Start, stop and inspect the local broker described by ``local`` and ``bootstrap``.

    ``bootstrap`` is the client bootstrap list; its first server gives the host and port the
    broker listens on. ``repo_root`` locates infra/kafka (pom.xml and config templates).
    """

    template = "server.properties"
    state_name = "kafka"
    serves_tls = False
    """Whether its clients talk TLS to it (the JVM's AES-GCM intrinsics are C2's: ``kafka_jit``)."""

    def __init__(self, local: LocalSettings, bootstrap: str, repo_root: Path,
                 probe_timeout_s: float = 5.0) -> None:
        self.local = local
        self.host, self.port = _first_server(bootstrap)
        self.bootstrap = f"{self.host}:{self.port}"
        self.controller_port = local.kafka_controller_port
        self.infra = repo_root.resolve() / "infra" / "kafka"
        self.root = local.state_dir / self.state_name
        self.pid_file = self.root / "broker.json"
        self.libs = local.cache_dir / f"kafka-{local.kafka_version}" / "libs"
        self._complete = self.libs.parent / "libs.complete"
        self.probe_timeout_s = probe_timeout_s

    def ensure_jars(self) -> Path:
        """The folder of broker jars, fetched with Maven on first use of a Kafka version.

        A marker file is written only after a complete copy, so an interrupted copy is
        redone. Raises LocalStackError if Maven is missing or the fetch fails.
        """
        if self._complete.exists():
            return self.libs
        # The cache is shared by every state dir (tests use their own), so fetch under a lock.
        with procs.state_lock(self.libs.parent / "fetch.lock"):
            if self._complete.exists():
                return self.libs  # another process finished the fetch while we waited
            mvn = procs.require_tool("mvn", _MVN_HINT)
            fresh = self.libs.with_name("libs.partial")
            shutil.rmtree(fresh, ignore_errors=True)
            procs.run_tool(
                [mvn, "-B", "-q", "dependency:copy-dependencies", "-DincludeScope=runtime",
                 f"-DoutputDirectory={fresh}", f"-Dkafka.version={self.local.kafka_version}"],
                f"Fetching the Kafka {self.local.kafka_version} jars from Maven Central",
                timeout_s=900, cwd=self.infra,
            )
            broker_jar = fresh / f"kafka_2.13-{self.local.kafka_version}.jar"
            if not broker_jar.exists():
                raise LocalStackError(
                    f"Maven finished but {broker_jar.name} is missing; check infra/kafka/pom.xml.")
            # Swap, not delete-then-copy: a broker may be running from an unmarked libs dir
            # and must never find a jar missing when its class loader opens it.
            stale = self.libs.with_name("libs.stale")
            shutil.rmtree(stale, ignore_errors=True)
            if self.libs.exists():
                self.libs.rename(stale)
            fresh.rename(self.libs)
            shutil.rmtree(stale, ignore_errors=True)
            self._complete.write_text(self.local.kafka_version + "\n")
        return self.libs

    def start(self, timeout_s: float = 90) -> KafkaStatus:
        """Make a healthy broker answer on ``bootstrap`` and return its status.

        Idempotent: our broker already running is reused (waited for if still starting);
        a broker someone else runs on the port is reused and reported ``external``.
        Otherwise stale run directories are deleted, a fresh one is formatted, and the broker
        is started detached. Raises LocalStackError, with the last 20 log lines where there
        is a log, if the broker exits or is not ready within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with procs.state_lock(self.root / "start.lock"):
            record = procs.read_pid_file(self.pid_file)
            if record is not None and record.is_running():
                theirs = record.extra.get("bootstrap")
                if theirs != self.bootstrap:
                    raise LocalStackError(
                        f"The local broker from {self.root} serves {theirs}, not {self.bootstrap}; "
                        "run `mmstream down` first.")
                self._wait_ready(record, deadline)
                return self.status()
            if self._answers(self.bootstrap):
                return self.status()  # someone else's broker: reuse it, reported external
            self._check_ports_free()
            java = _require_java()
            libs = self.ensure_jars()
            self._remove_stale_runs()
            record = self._launch(java, libs)
            try:
                self._wait_ready(record, deadline)
            except LocalStackError:
                procs.terminate(record.pid, grace_s=10, started=record.started)
                self.pid_file.unlink(missing_ok=True)
                raise
            return self.status()

    def stop(self, grace_s: float = 60) -> KafkaStatus:
        """Stop our broker (SIGTERM, then SIGKILL after ``grace_s``) and return the status after.

        An external broker is left alone. The run directory is kept for its log until the
        next start.
        """
        procs.stop_recorded(self.pid_file, self.root / "start.lock", grace_s)
        return self.status()

    def running(self) -> bool:
        """Whether our broker (the one this state dir's pid file records) runs for
        ``bootstrap``; asks the broker nothing, so it is instant."""
        record = procs.read_pid_file(self.pid_file)
        return record is not None and record.is_running() and record.extra.get("bootstrap") == self.bootstrap

    def status(self) -> KafkaStatus:
        """Our broker's state if one runs, else whether some other broker serves ``bootstrap``."""
        record = procs.read_pid_file(self.pid_file)
        if record is not None and record.is_running():
            run_dir = self.root / str(record.extra.get("run_id"))
            bootstrap = str(record.extra.get("bootstrap", self.bootstrap))
            return KafkaStatus(True, record.pid, bootstrap, self._answers(bootstrap), False,
                               run_dir / "data", run_dir / "broker.log")
        external = self._answers(self.bootstrap)
        return KafkaStatus(external, None, self.bootstrap, external, external, None, None)

    # -- internals -------------------------------------------------------------------------

    def _check_ports_free(self) -> None:
        if procs.is_port_open(self.host, self.port):
            raise LocalStackError(
                f"Port {self.port} on {self.host} is taken by something that is not a Kafka broker; "
                "free it or set MMSTREAM_KAFKA_BOOTSTRAP to another port.")
        if not procs.is_loopback(self.host):
            raise LocalStackError(
                f"No broker answers on {self.bootstrap}, and `mmstream up` only starts one on this "
                "machine's loopback address (127.0.0.1 or localhost).")
        for port, setting in self._other_ports():
            if procs.is_port_open(self.host, port):
                raise LocalStackError(
                    f"The port {port} on {self.host} is taken; free it or set MMSTREAM_LOCAL_{setting.upper()} "
                    "to another port.")

    def _other_ports(self) -> list[tuple[int, str]]:
        """(port, its setting in ``LocalSettings``) of every listener but the client one."""
        return [(self.controller_port, "kafka_controller_port")]

    def _template_values(self, run_dir: Path) -> dict[str, Any]:
        """The values of the broker config template's placeholders."""
        return dict(node_id=NODE_ID, host=self.host, port=self.port, controller_port=self.controller_port,
                    log_dir=run_dir / "data")

    def _format_args(self) -> list[str]:
        """Extra arguments of ``StorageTool format`` (credentials to add at format time)."""
        return []

    def client_kwargs(self) -> dict[str, Any]:
        """aiokafka security options for talking to this broker (the readiness probe)."""
        return {}

    def _remove_stale_runs(self) -> None:
        # Called only when none of our brokers runs, so every run directory is stale.
        if not self.root.is_dir():
            return
        for child in self.root.iterdir():
            if child.is_dir() and _RUN_ID.fullmatch(child.name):
                shutil.rmtree(child, ignore_errors=True)

    def _launch(self, java: str, libs: Path) -> procs.PidRecord:
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        run_dir = self.root / run_id
        (run_dir / "data").mkdir(parents=True)
        props = run_dir / "server.properties"
        template = Template((self.infra / self.template).read_text())
        props.write_text(template.substitute(self._template_values(run_dir)) + failover_lines())
        log4j = f"-Dlog4j2.configurationFile={self.infra / 'log4j2.xml'}"
        classpath = f"{libs}/*"  # java expands the wildcard itself; no shell involved
        # Through a Java argument file (mode 0600, removed after): the format arguments may
        # hold a password, which a command line would show in /proc and in a timeout's message.
        argfile = run_dir / "format.args"
        procs.write_private(argfile, "".join(
            _java_arg(a) + "\n" for a in [log4j, "-cp", classpath, "kafka.tools.StorageTool", "format",
                                           "-t", _cluster_id(), "-c", str(props), *self._format_args()]))
        try:
            procs.run_tool([java, f"@{argfile}"], "Formatting the Kafka data directory", timeout_s=60)
        finally:
            argfile.unlink(missing_ok=True)
        pid = procs.start_detached(
            [java, *broker_jvm_options(self.local, self.serves_tls), log4j, "-cp", classpath, "kafka.Kafka",
             str(props)],
            run_dir / "broker.log", cwd=run_dir, nice=self.local.nice_of("broker"),
        )
        return procs.write_pid_file(self.pid_file, pid, run_id=run_id, bootstrap=self.bootstrap)

    def _wait_ready(self, record: procs.PidRecord, deadline: float) -> None:
        log = self.root / str(record.extra.get("run_id")) / "broker.log"
        while True:
            if not record.is_running():
                raise LocalStackError(f"The Kafka broker exited while starting; {log} ends with:\n"
                                      + procs.tail(log))
            # The client port opens only once startup is complete ("Kafka Server started"
            # in the log), so one answered metadata request is the readiness test.
            if self._answers(self.bootstrap):
                return
            if time.monotonic() >= deadline:
                raise LocalStackError(f"The Kafka broker was not ready in time; {log} ends with:\n"
                                      + procs.tail(log))
            time.sleep(0.2)

    def _answers(self, bootstrap: str) -> bool:
        host, port = _first_server(bootstrap)
        if not procs.is_port_open(host, port):
            return False  # skip the client's slower connect-and-retry path
        return metadata_round_trip(bootstrap, self.probe_timeout_s, self.client_kwargs())


def failover_lines() -> str:
    """``FAILOVER_PROPERTIES`` as server.properties lines (after a newline)."""
    return "\n" + "".join(f"{k}={v}\n" for k, v in FAILOVER_PROPERTIES.items())


def metadata_round_trip(bootstrap: str, timeout_s: float, client_kwargs: dict[str, Any] | None = None) -> bool:
    """True if a Kafka broker at ``bootstrap`` answers a metadata request within ``timeout_s``
    (``client_kwargs``: how to authenticate).

    Runs its own event loop in a worker thread, so it may be called from sync code and from
    inside a running loop alike.
    """
    async def probe() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap,
                                    request_timeout_ms=int(timeout_s * 1000), **(client_kwargs or {}))
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            await asyncio.wait_for(admin.list_topics(), timeout_s)
            return True
        finally:
            await admin.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            return pool.submit(asyncio.run, probe()).result()
        except Exception:  # any failure, whatever the client raises, means "not healthy"
            return False


C1_ONLY = "-XX:TieredStopAtLevel=1"
"""The JVM's quick compiler only: no C2 recompiles competing for a small box's cores."""


def broker_jvm_options(local: LocalSettings, tls: bool = False) -> list[str]:
    """The local broker's JVM options: its heap, its compilers (``local.kafka_jit``; ``auto`` is
    C1 only for a broker without TLS), and exit on running out of memory (a broker out of memory
    is broken; exiting lets status() say so)."""
    heap = local.kafka_heap_mb
    c1 = local.kafka_jit == "c1" or (local.kafka_jit == "auto" and not tls)
    return [f"-Xmx{heap}m", f"-Xms{heap // 2}m", *([C1_ONLY] if c1 else []),
            "-XX:+ExitOnOutOfMemoryError"]


def _require_java() -> str:
    java = procs.require_tool("java", _JAVA_HINT)
    done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if match is None:
        raise LocalStackError(f"{java} -version did not say its version. {_JAVA_HINT}")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0_392" style
        major = int(match.group(2))
    if major < 17:
        raise LocalStackError(f"Found Java {major} at {java}; {_JAVA_HINT}")
    return java


def _cluster_id() -> str:
    # What `StorageTool random-uuid` prints (a random UUID, URL-safe base64 without padding,
    # never starting with '-'), made here to save one JVM start per run.
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _first_server(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip()
    first = first.split("://", 1)[-1]  # tolerate PLAINTEXT://host:port
    host, sep, port = first.rpartition(":")
    if not sep or not port.isdigit():
        raise LocalStackError(f"Kafka bootstrap {bootstrap!r} is not host:port.")
    return host.strip("[]") or "127.0.0.1", int(port)


def _java_arg(arg: str) -> str:
    """One argument as a line of a Java launcher argument file (``java @file``): quoted, with
    backslashes and quotes escaped."""
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
