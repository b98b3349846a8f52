"""Prometheus finds local workers through the file_sd targets the supervisor writes: every
live worker with a known port, nothing else."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from mmstream.supervisor import Supervisor, WorkerProc
from schemas.settings import Settings


def test_targets_list_every_live_worker_and_only_those(tmp_path):
    settings = Settings.from_env({"MMSTREAM_LOCAL_STATE_DIR": str(tmp_path), "MMSTREAM_METRICS_BIND": "0.0.0.0"})
    sup = Supervisor(settings, env={})
    sup.dir.mkdir(parents=True)
    dead_pid = 2 ** 22 + 12345  # above the default pid_max: never a live process
    workers = [WorkerProc("router", 0, os.getpid(), str(sup.dir / "router-0.log"), 0.0, 9400),
               WorkerProc("encode.text", 1, os.getpid(), str(sup.dir / "encode.text-1.log"), 0.0, 0),
               WorkerProc("generate", 0, dead_pid, str(sup.dir / "generate-0.log"), 0.0, 9402)]
    for w in workers:
        (sup.dir / f"{w.stage}-{w.replica}.json").write_text(json.dumps(asdict(w)))
    (sup.dir / "encode.text-1.port").write_text("40123")  # picked its own port and reported it
    path = sup.write_targets()
    assert path == tmp_path / "prometheus" / "targets" / "mm.json"
    groups = json.loads(path.read_text())
    assert groups == [{"targets": ["127.0.0.1:40123"], "labels": {"worker": "encode.text[1]"}},
                      {"targets": ["127.0.0.1:9400"], "labels": {"worker": "router[0]"}}]
    sup.write_targets([])
    assert json.loads(path.read_text()) == []
