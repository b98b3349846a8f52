"""Liveness, readiness and in-flight items of one worker process: what its ``/healthz``,
``/readyz`` and ``mmstream_inflight`` report.

- live (``/healthz``): the process answers and no component reports itself dead (a Faust
  app that crashed). Kubernetes restarts a worker that fails it; compose marks it unhealthy.
- ready (``/readyz``): at least one check is registered and every one passes. A stage's
  Faust app registers "running and fully started" (its engine loads and warms up before the
  app starts, so that includes "engine loaded"); the lag monitor registers "the last read of
  the offsets succeeded recently". Rollouts wait for it.

A check is a callable read from the metrics server's thread: cheap, read-only, and a check
that raises counts as failing. A worker process runs one stage, so there is one
``WorkerHealth`` per process (``process_health()``): the app factory registers into it and
``streams.observe.http.serve`` reads it, without the stage runner having to hand it around. Tests
and tools that want their own pass one explicitly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Iterable

Check = Callable[[], bool]


class WorkerHealth:
    """Named readiness and liveness checks, and the items each stage holds right now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[str, Check] = {}
        self._live: dict[str, Check] = {}
        self._inflight: dict[str, int] = {}
        self.stage: str | None = None
        """The stage this process runs, once known (labels ``mmstream_ready``)."""
        self.born_at = process_started_at()
        self.cold_start_s: dict[str, float] = {}
        """Phase -> seconds from the process's start: ``ready`` (the stage fully started, its
        engine loaded and warm) and ``first_answer`` (its first item answered). Set once each."""

    def mark(self, phase: str) -> None:
        """Record that ``phase`` of the cold start is reached now (only the first time)."""
        if phase not in self.cold_start_s:
            with self._lock:
                self.cold_start_s.setdefault(phase, max(0.0, time.time() - self.born_at))

    def require(self, name: str, ready: Check, live: Check | None = None) -> None:
        """Register (or replace) check ``name``: ``ready`` gates /readyz, ``live`` /healthz."""
        with self._lock:
            self._ready[name] = ready
            if live is not None:
                self._live[name] = live

    def readiness(self) -> dict[str, bool]:
        return _run(self._snapshot(self._ready))

    def liveness(self) -> dict[str, bool]:
        return _run(self._snapshot(self._live))

    def ready(self) -> bool:
        checks = self.readiness()
        return bool(checks) and all(checks.values())

    def live(self) -> bool:
        return all(self.liveness().values())

    def set_inflight(self, stage: str, n: int) -> None:
        """Record that ``stage`` holds ``n`` items (consumed, not yet finished)."""
        with self._lock:
            self._inflight[stage] = max(0, int(n))

    def inflight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._inflight)

    def _snapshot(self, checks: dict[str, Check]) -> list[tuple[str, Check]]:
        with self._lock:
            return list(checks.items())


def process_started_at(pid: int | str = "self") -> float:
    """Wall-clock time the process was forked (Linux: its start tick in ``/proc``), so a cold
    start counts the interpreter and the imports too; now, where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(") ", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _run(checks: Iterable[tuple[str, Check]]) -> dict[str, bool]:
    out = {}
    for name, check in checks:
        try:
            out[name] = bool(check())
        except Exception:  # noqa: BLE001 - a check that cannot tell is a failing check
            out[name] = False
    return out


_PROCESS: WorkerHealth | None = None
_PROCESS_LOCK = threading.Lock()


def process_health() -> WorkerHealth:
    """This process's ``WorkerHealth``, created on first use."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = WorkerHealth()
        return _PROCESS


def probe(health: WorkerHealth, path: str) -> tuple[int, dict[str, Any]] | None:
    """The HTTP status and JSON body of ``/healthz`` or ``/readyz``; None for other paths.

    200 when live (ready), 503 when not; the body names every check and its result."""
    if path == "/healthz":
        checks = health.liveness()
        ok = all(checks.values())
    elif path == "/readyz":
        checks = health.readiness()
        ok = bool(checks) and all(checks.values())
    else:
        return None
    return (200 if ok else 503), {"ok": ok, "stage": health.stage, "checks": checks}


def probe_body(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, sort_keys=True) + "\n").encode()
