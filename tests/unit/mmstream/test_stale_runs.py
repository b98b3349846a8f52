"""What earlier pipelines left in the state directory (each bench's, test's and chaos run's own
prefix) is removed once no worker of it runs and nothing was written to it for two days; a
pipeline running, one written to lately, and the one starting are kept."""

from __future__ import annotations

import json
import os
import time

from mmstream.supervisor import STALE_RUN_S, prune_stale_runs

DEAD_PID = 2 ** 22 + 12345  # above the default pid_max: never a live process


def _run(state, prefix: str, pid: int, age_s: float) -> None:
    d = state / "workers" / prefix
    d.mkdir(parents=True)
    (d / "router-0.json").write_text(json.dumps({"stage": "router", "replica": 0, "pid": pid}))
    (d / "router-0.log").write_text("...")
    targets = state / "prometheus" / "targets"
    targets.mkdir(parents=True, exist_ok=True)
    (targets / f"{prefix}.json").write_text("[]")
    then = time.time() - age_s
    for f in (*d.iterdir(), d, targets / f"{prefix}.json"):
        os.utime(f, (then, then))


def test_only_old_runs_with_no_live_worker_are_removed(tmp_path) -> None:
    old = STALE_RUN_S + 3600
    _run(tmp_path, "benchdead", DEAD_PID, old)
    _run(tmp_path, "benchlive", os.getpid(), old)  # a worker still runs
    _run(tmp_path, "benchnew", DEAD_PID, 3600)  # written an hour ago
    _run(tmp_path, "mm", DEAD_PID, old)  # the pipeline starting now
    assert prune_stale_runs(tmp_path, keep="mm") == ["benchdead"]
    left = sorted(p.name for p in (tmp_path / "workers").iterdir())
    assert left == ["benchlive", "benchnew", "mm"]
    assert not (tmp_path / "prometheus" / "targets" / "benchdead.json").exists()
    assert (tmp_path / "prometheus" / "targets" / "benchlive.json").exists()


def test_a_run_whose_log_was_written_lately_is_kept_though_its_directory_is_old(tmp_path) -> None:
    _run(tmp_path, "benchidle", DEAD_PID, STALE_RUN_S + 3600)
    os.utime(tmp_path / "workers" / "benchidle" / "router-0.log")  # appended to now: not the directory's time
    assert prune_stale_runs(tmp_path, keep="mm") == []


def test_a_warm_spares_fifo_goes_with_its_run(tmp_path) -> None:
    _run(tmp_path, "benchspare", DEAD_PID, STALE_RUN_S + 3600)
    run = tmp_path / "workers" / "benchspare"
    os.mkfifo(run / "spare.fifo")
    then = time.time() - STALE_RUN_S - 3600
    for f in (run / "spare.fifo", run):
        os.utime(f, (then, then))
    assert prune_stale_runs(tmp_path, keep="mm") == ["benchspare"] and not run.exists()


def test_a_state_dir_without_workers_is_left_alone(tmp_path) -> None:
    assert prune_stale_runs(tmp_path, keep="mm") == []
