"""A pipeline started for a process of its own (``local.parent_pid``: a bench's
``--own-pipeline``, these tests' pipelines) does not outlive that process when it is killed
without its cleanup: a real worker, its starter SIGKILLed, stops by itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from schemas.settings import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

STARTER = """
import os, subprocess, sys, time
env = dict(os.environ, MMSTREAM_LOCAL_PARENT_PID=str(os.getpid()))  # what a bench does (mmstream.levers)
with open(sys.argv[1], "ab") as log:
    worker = subprocess.Popen([sys.executable, "-m", "mmstream.cli", "worker", "lagmon", "--replica", "0"], env=env,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
print(worker.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped yet has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_tied_worker_stops_when_its_starter_is_killed(infra: Settings, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MMSTREAM_KAFKA_TOPIC_PREFIX": f"orphan{uuid.uuid4().hex[:8]}",
           "MMSTREAM_METRICS_PORT": "0", "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path / "state")}
    log = tmp_path / "worker.log"  # what the worker said, if this fails
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(log)], env=env, stdout=subprocess.PIPE, text=True)
    worker = int(starter.stdout.readline())
    try:
        time.sleep(3.0)
        assert _running(worker)  # its starter lives: it runs
        starter.kill()  # no cleanup of its own, as a CI timeout or `kill -9` would do
        starter.wait()
        deadline = time.monotonic() + 60
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(worker), log.read_text()[-2000:]
    finally:
        if _running(worker):
            os.kill(worker, 9)
        if starter.poll() is None:
            starter.kill()
