"""The workers `mmstream up` starts run at the CPU priority ``local.nice`` gives their stage
(mmstream/priority.py): the router and the assembler ahead of the pools, which run at 0."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")]


def test_the_router_and_the_assembler_run_ahead_of_the_pools_for_the_cpu(pipeline):
    workers = {w.stage: w for w in pipeline.supervisor.workers()}
    local = pipeline.settings.local
    # A raise needs root (or CAP_SYS_NICE): without, a stage runs at 0 and says so in its log.
    raised = os.geteuid() == 0
    for stage in ("router", "assembler"):
        nice = local.nice_of(stage)
        assert nice < 0, stage  # the defaults this test is about
        pid = workers[stage].pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == (nice if raised else 0), stage
        group = Path(f"/proc/{pid}/autogroup")
        if group.exists():
            assert f"nice {nice if raised else 0}" in group.read_text(), stage
        if not raised:
            assert "runs at its default CPU priority" in Path(workers[stage].log_file).read_text()
    for stage in ("encode.text", "encode.image"):
        assert local.nice_of(stage) == 0
        assert os.getpriority(os.PRIO_PROCESS, workers[stage].pid) == 0, stage
