"""The offload process (workers/offload.py), on real processes: a session of its own at the
nice value asked, exceptions back as themselves, a death that costs one call, and no process
left behind when its worker dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from schemas.errors import ErrorCode, WireError
from workers.offload import Offload, OffloadDied

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sessions and nice values are Linux's")

REPO = Path(__file__).resolve().parents[3]


def where_am_i() -> tuple[int, int, int, str]:
    group = Path("/proc/self/autogroup")
    return os.getpid(), os.getsid(0), os.getpriority(os.PRIO_PROCESS, 0), group.read_text() if group.exists() else ""


def refuse() -> None:
    raise WireError(ErrorCode.UNSUPPORTED_MEDIA, "not a picture", "parts.3")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def offload():
    o = Offload(nice=15)
    yield o
    o.close()


def test_a_call_runs_in_a_session_of_its_own_at_the_nice_value(offload):
    pid, sid, nice, group = offload.call(where_am_i)
    assert pid != os.getpid() and sid == pid  # leads its own session: an autogroup of its own
    assert nice == 15
    if group:  # the kernel has autogroups: the session's is lowered too
        assert group.strip().endswith("nice 15"), group
    assert offload.call(where_am_i)[0] == pid  # one process, kept


def test_an_exception_comes_back_as_itself(offload):
    with pytest.raises(WireError) as caught:
        offload.call(refuse)
    assert caught.value.code == ErrorCode.UNSUPPORTED_MEDIA and caught.value.field == "parts.3"
    assert offload.call(where_am_i)[0] > 0  # and the process is still there


def test_a_death_costs_its_call_and_the_next_one_gets_a_new_process(offload):
    first = offload.call(where_am_i)[0]
    with pytest.raises(OffloadDied):
        offload.call(die)
    second = offload.call(where_am_i)[0]
    assert second != first and offload.restarts == 1


def test_the_process_dies_with_its_worker():
    script = textwrap.dedent("""
        import sys, time
        from tests.unit.workers.test_offload import where_am_i
        from workers.offload import Offload
        print(Offload(nice=15).call(where_am_i)[0], flush=True)
        time.sleep(60)
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        assert _running(child)  # alive while its worker is
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _running(child):
            return
        time.sleep(0.05)
    pytest.fail(f"offload process {child} outlived its worker")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, or not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
