"""Local worker processes for `mmstream up`: N replicas per stage, detached, with pid files
and logs under ``<state_dir>/workers/<topic_prefix>/``.

The stages it knows are ``streams.stages.stage_names()`` once the settings' modality
plugins are loaded; each modality's spec says how many replicas of its stage start by
default (``default_replicas``).

Each pid file records the broker its worker was started against: one prefix of a state
dir has one set of workers, so ``start`` refuses (``WorkersElsewhereError``) while live
workers of the prefix talk to another broker (the plaintext one of `mmstream up` and the
secured one of `mmstream up --secure`), rather than reuse workers that cannot answer.

Prometheus finds them through file-based service discovery: after every start and stop the
supervisor rewrites ``<state_dir>/prometheus/targets/<topic_prefix>.json`` with the metrics
address of each live worker (infra/prometheus/prometheus.yml reads that folder), so every
replica is scraped and no port is scraped that nobody serves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mmstream import standby
from schemas.settings import Settings
from schemas.settings_base import parse_assignments, whole_number
from streams.runtime.parent import PARENT_PID_ENV
from streams.stages import stage_names
from workers import modalities


AUTOSCALER = "autoscale"
"""The local scaler's worker (``mmstream.autoscaler``): local only, so not a stage of the
topology; on Kubernetes KEDA does its job from the same settings."""


def default_replicas() -> dict[str, int]:
    """Workers per stage that `mmstream up` starts: one of each fixed stage and each
    registered modality's own count (none of the baseline's shared pool)."""
    out = {"router": 1, "assembler": 1}
    out.update((s.stage, s.replicas) for s in modalities.specs())
    out.update(generate=1, index=1, retrieve=1, lagmon=1)
    return out


@dataclass(frozen=True)
class WorkerProc:
    stage: str
    replica: int
    pid: int
    log_file: str
    started_at: float
    assigned_port: int = 0
    """The metrics port handed to the worker (0: it picks one and writes it to its .port file)."""
    bootstrap: str = ""
    """The broker it was started against (``MMSTREAM_KAFKA_BOOTSTRAP``); empty in a pid file
    written before this was recorded."""

    @property
    def alive(self) -> bool:
        return _alive(self.pid)

    @property
    def metrics_port(self) -> int | None:
        """The port this worker serves /metrics on, once it has bound it."""
        try:
            return int(Path(self.log_file).with_suffix(".port").read_text())
        except (OSError, ValueError):
            return self.assigned_port or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` from /proc/<pid>/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def parse_replicas(specs: list[str]) -> dict[str, int]:
    """``["encode.text=2"]`` -> ``{"encode.text": 2}``; raises ``ValueError`` on bad input."""
    return parse_assignments(specs, whole_number, "STAGE=N (--replicas)")


class WorkersElsewhereError(ValueError):
    """Live workers of this prefix talk to another broker than the one asked for."""

    def __init__(self, message: str, theirs: str, workers: list[WorkerProc]) -> None:
        super().__init__(message)
        self.theirs = theirs
        """The broker they talk to ("" when their pid files do not say)."""
        self.workers = workers


SPARE = "spare"
"""The warm spare's pid file name (``mmstream.standby``): a process with its imports done."""


STALE_RUN_S = 2 * 86400.0
"""How long the logs of a pipeline no longer running are kept (see ``prune_stale_runs``)."""


def prune_stale_runs(state_dir: Path, keep: str, older_than_s: float = STALE_RUN_S, now: float | None = None) -> list[str]:
    """Remove what earlier pipelines left under ``state_dir``: the worker directory (logs, pid
    and port files) and Prometheus targets of every topic prefix but ``keep`` that has no live
    worker and was last written over ``older_than_s`` ago. Every bench's own pipeline, every
    test's and chaos run's has a prefix of its own, and nothing else removes them (one
    machine had 738, 218 MB). Faust's data (``state_dir/faust/<prefix>``: the retrieve stage's
    snapshots) is left: a prefix that starts again reads it. Not locked against a pipeline
    restarting the same stale prefix in the same milliseconds; one with a live worker is never
    touched. Returns the prefixes removed."""
    root = state_dir / "workers"
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for run in sorted(p for p in root.iterdir() if p.is_dir() and p.name != keep):
        try:
            files = [f for f in run.iterdir() if not f.is_dir()]  # a warm spare's FIFO too
            if now - run.stat().st_mtime < older_than_s or any(now - f.stat().st_mtime < older_than_s for f in files):
                continue
            if any(_alive(pid) for pid in (_pid_of(f) for f in files if f.suffix == ".json") if pid):
                continue
            for f in files:
                f.unlink(missing_ok=True)
            (state_dir / "prometheus" / "targets" / f"{run.name}.json").unlink(missing_ok=True)
            run.rmdir()
        except OSError:  # something in it that is not ours (a directory), or it changed meanwhile: kept
            continue
        removed.append(run.name)
    return removed


def _pid_of(pid_file: Path) -> int:
    try:
        return int(json.loads(pid_file.read_text()).get("pid") or 0)
    except (OSError, ValueError, AttributeError):
        return 0


class Supervisor:
    def __init__(self, settings: Settings, env: dict[str, str] | None = None, spares: bool = False) -> None:
        self.settings = settings
        self.env = dict(os.environ if env is None else env)
        self.dir = settings.local.state_dir / "workers" / settings.kafka.topic_prefix
        self.spares = spares
        """Start new replicas from a warm spare (``mmstream.standby``) and keep one waiting."""

    def _pidfile(self, stage: str, replica: int) -> Path:
        return self.dir / f"{stage}-{replica}.json"

    def workers(self) -> list[WorkerProc]:
        """Every worker with a pid file, alive or not."""
        if not self.dir.exists():
            return []
        procs = []
        for f in sorted(self.dir.glob("*.json")):
            try:
                procs.append(WorkerProc(**json.loads(f.read_text())))
            except (ValueError, TypeError):
                f.unlink(missing_ok=True)
        return procs

    def check_broker(self) -> None:
        """Raise ``WorkersElsewhereError`` if a live worker of this prefix was started against
        another broker than the settings' (or its pid file does not say which)."""
        ours = self.settings.kafka.bootstrap
        others = [w for w in self.workers() if w.alive and w.bootstrap != ours]
        if others:
            theirs = others[0].bootstrap
            where = theirs or "a broker their pid files do not name"
            raise WorkersElsewhereError(
                f"{len(others)} running worker(s) of topic prefix {self.settings.kafka.topic_prefix!r} talk to "
                f"{where}, not {ours}: stop them first with `mmstream down`", theirs, others)

    def start(self, replicas: dict[str, int]) -> list[WorkerProc]:
        """Make each stage run exactly ``replicas[stage]`` workers (idempotent). Loads the
        settings' modality plugins first, so their stages are known; raises ``ValueError``
        (``ModalityError`` for a plugin) naming what is unknown, and ``WorkersElsewhereError``
        (before touching any worker) while live workers of the prefix talk to another broker."""
        self.check_broker()
        prune_stale_runs(self.settings.local.state_dir, keep=self.settings.kafka.topic_prefix)
        modalities.load_plugins(self.settings.modalities.plugins)
        stages = (*stage_names(), AUTOSCALER)
        unknown = set(replicas) - set(stages)
        if unknown:
            raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}; stages: {', '.join(stages)}")
        for stage, count in replicas.items():
            self.stop_beyond(stage, count)
            self.spawn_missing(stage, count)
        live = [w for w in self.workers() if w.alive]
        self.write_targets(live)
        return live

    def spawn_missing(self, stage: str, count: int) -> list[WorkerProc]:
        """Start replicas ``0..count-1`` of ``stage`` that are not running (no checks: ``start``
        makes them); returns those started."""
        self.dir.mkdir(parents=True, exist_ok=True)
        running = {w.replica for w in self.workers() if w.alive and w.stage == stage}
        return [self._spawn(stage, r) for r in range(count) if r not in running]

    def stop_beyond(self, stage: str, count: int, grace_s: float = 30.0) -> int:
        """Stop the replicas of ``stage`` numbered ``count`` and up, highest first (SIGTERM, each
        finishing its batch); returns how many."""
        extra = sorted((w for w in self.workers() if w.alive and w.stage == stage and w.replica >= count),
                       key=lambda w: -w.replica)
        for w in extra:
            self.stop_one(w, grace_s)
        return len(extra)

    def targets_file(self) -> Path:
        return self.settings.local.state_dir / "prometheus" / "targets" / f"{self.settings.kafka.topic_prefix}.json"

    def write_targets(self, workers: list[WorkerProc] | None = None) -> Path:
        """Write the Prometheus file_sd targets of the live workers (atomically: Prometheus
        may read the file at any moment); a worker whose port is not known yet is left out
        until the next call."""
        bind = self.settings.metrics.bind
        host = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
        live = [w for w in (self.workers() if workers is None else workers) if w.alive]
        groups = [{"targets": [f"{host}:{port}"], "labels": {"worker": f"{w.stage}[{w.replica}]"}}
                  for w in live if (port := w.metrics_port)]
        path = self.targets_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        tmp.replace(path)
        return path

    def _next_port(self) -> int:
        """Lowest port from the base that no live worker uses (0 when the base is 0: the
        worker picks a free one and reports it)."""
        base = self.settings.local.metrics_base_port
        if base == 0:
            return 0
        used = {w.assigned_port for w in self.workers() if w.alive}
        port = base
        while port in used:
            port += 1
        return port

    def _env(self, port: int) -> dict[str, str]:
        # numpy's BLAS on one thread: a worker's matrix products are small (the retrieve
        # stage's reuse lookup: 1024 x 384), and on a busy box OpenBLAS's own threads made one
        # take 3.4 ms instead of 0.09 (docs/retrieval.md). Engines size their own threads.
        env = {"OPENBLAS_NUM_THREADS": "1", **self.env, "MMSTREAM_METRICS_PORT": str(port)}
        if env.get(PARENT_PID_ENV, "0") not in ("", "0"):
            # Tied to whoever starts it (local.parent_pid): this process, which may itself be a
            # worker tied to another (the local scaler a bench started), so a chain stops together.
            env[PARENT_PID_ENV] = str(os.getpid())
        return env

    def _popen(self, args: list[str], log_file: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log_file, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def _spawn(self, stage: str, replica: int) -> WorkerProc:
        log_file = self.dir / f"{stage}-{replica}.log"
        log_file.with_suffix(".port").unlink(missing_ok=True)
        port = self._next_port()
        env = self._env(port)
        spare = self._spare() if self.spares else None
        if spare is not None and standby.handover(str(self._fifo()), stage, replica, str(log_file), env):
            pid = spare.pid
            self._pidfile(SPARE, 0).unlink(missing_ok=True)
        else:
            pid = self._popen(["mmstream.cli", "worker", stage, "--replica", str(replica)], log_file, env).pid
        w = WorkerProc(stage, replica, pid, str(log_file), time.time(), port, self.settings.kafka.bootstrap)
        self._pidfile(stage, replica).write_text(json.dumps(asdict(w)))
        if self.spares:
            self.ensure_spare()
        return w

    def _fifo(self) -> Path:
        return self.dir / f"{SPARE}.fifo"

    def _spare(self) -> WorkerProc | None:
        return next((w for w in self.workers() if w.stage == SPARE and w.alive), None)

    def ensure_spare(self) -> WorkerProc:
        """The live warm spare, started now if there is none."""
        spare = self._spare()
        if spare is not None:
            return spare
        self.dir.mkdir(parents=True, exist_ok=True)
        fifo = self._fifo()
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)
        log_file = self.dir / f"{SPARE}-0.log"
        proc = self._popen(["mmstream.standby", str(fifo)], log_file, self._env(0))
        w = WorkerProc(SPARE, 0, proc.pid, str(log_file), time.time(), 0, self.settings.kafka.bootstrap)
        self._pidfile(SPARE, 0).write_text(json.dumps(asdict(w)))
        return w

    def stop_one(self, w: WorkerProc, grace_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """Signal one worker (SIGTERM: graceful, commits offsets) and wait for it to exit."""
        try:
            os.kill(w.pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while _alive(w.pid) and time.monotonic() < deadline:
            _reap(w.pid)
            time.sleep(0.1)
        if _alive(w.pid):
            os.kill(w.pid, signal.SIGKILL)
            while _alive(w.pid):
                _reap(w.pid)
                time.sleep(0.05)
        _reap(w.pid)
        self._pidfile(w.stage, w.replica).unlink(missing_ok=True)
        Path(w.log_file).with_suffix(".port").unlink(missing_ok=True)

    def stop(self, grace_s: float = 30.0) -> int:
        """Stop every worker of this topic prefix; returns how many were running."""
        procs = [w for w in self.workers()]
        for w in procs:  # the scaler first: it would start again what is being stopped
            if w.stage == AUTOSCALER:
                self.stop_one(w, grace_s)
        for w in procs:
            if w.alive:
                os.kill(w.pid, signal.SIGTERM)
        for w in procs:
            self.stop_one(w, grace_s)
        self.write_targets([])
        return sum(1 for _ in procs)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
