"""A worker `mmstream up` starts runs at the CPU priority ``local.nice`` names for its stage
(streams/runtime/priority.py), and every other at the default. The session's pipeline lowers its lag
monitor (a lowering needs no privilege, so this reads the same for any user)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")]


def test_a_worker_runs_at_the_priority_named_for_its_stage_and_the_others_at_zero(pipeline):
    workers = {w.stage: w for w in pipeline.supervisor.workers()}
    nice = pipeline.settings.local.nice_of("lagmon")
    assert nice == 3  # conftest's pipeline
    lagmon = workers["lagmon"].pid
    tids = [int(t) for t in os.listdir(f"/proc/{lagmon}/task")]
    assert tids and all(os.getpriority(os.PRIO_PROCESS, t) >= nice for t in tids)  # threads started later inherit it
    assert os.getpriority(os.PRIO_PROCESS, lagmon) == nice
    group = Path(f"/proc/{lagmon}/autogroup")
    if group.exists():  # a kernel with autogroups: each worker leads a session of its own
        assert f"nice {nice}" in group.read_text()
    for stage in ("router", "assembler", "encode.text", "encode.image"):
        assert os.getpriority(os.PRIO_PROCESS, workers[stage].pid) == 0, stage
