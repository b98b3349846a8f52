"""Batch timings measured once per machine and engine, reused by the replicas started after.

An encoder times a few batch shapes before it serves (``Runner.calibrate``), to seed its
batch cost model, and the generator times prompt and decode steps
(``streams.cores.generation.calibrate``); on this box that is up to a second of a cold
start, spent again by every replica of the same engine. The timings depend on the engine (model, version, precision,
preprocessing: the runner's identity), its threads and the machine, so they are kept under
that key in ``<state_dir>/calibration/`` and a replica younger than ``max_age_s`` reads them
instead. A file that cannot be read or parsed is a miss: the replica times its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

Rows = list[tuple[float, ...]]
"""Whatever a stage timed, one tuple of numbers per observation (an encoder: batch size,
length, ms; the generator: ms, decode rows, prompt tokens)."""


def machine() -> str:
    """What the timings depend on besides the engine: cores and CPU model."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{os.cpu_count()}x{model}"


class CalibrationCache:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def _path(self, identity: str, threads: int) -> Path:
        key = hashlib.sha256(f"{identity}|{threads}|{machine()}".encode()).hexdigest()[:24]
        return self.directory / f"{key}.json"

    def load(self, identity: str, threads: int, max_age_s: float, now: float | None = None) -> Rows | None:
        if not identity or max_age_s <= 0:
            return None
        now = time.time() if now is None else now
        try:
            data = json.loads(self._path(identity, threads).read_text())
            if data["identity"] != identity or now - float(data["at"]) > max_age_s:
                return None
            return [tuple(float(v) for v in row) for row in data["rows"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, identity: str, threads: int, rows: Rows, now: float | None = None) -> None:
        """Keep ``rows`` (atomically: a replica reading at the same moment sees the old file or
        this one). Best effort: a read-only state dir only costs the next replica its timing."""
        if not identity or not rows:
            return
        path = self._path(identity, threads)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"identity": identity, "threads": threads, "machine": machine(),
                                       "at": time.time() if now is None else now, "rows": rows}))
            tmp.replace(path)
        except OSError:
            pass
