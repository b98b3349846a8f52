"""CPU priority of local processes (streams/runtime/priority.py), on real child processes: only
lowering, which needs no privilege, so the tests run the same for any user."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streams.runtime import priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")


def autogroup_nice(pid: int) -> int | None:
    """The nice value of ``pid``'s autogroup; None where it has none to show: a kernel without
    autogroups, or a process in init's session (the default group prints an empty file), as a
    CI runner started by a service manager is."""
    path = Path(f"/proc/{pid}/autogroup")
    text = path.read_text() if path.exists() else ""
    return int(text.split("nice")[1]) if "nice" in text else None


@pytest.fixture
def child():
    procs: list[subprocess.Popen] = []

    def start(own_session: bool) -> int:
        p = subprocess.Popen([sys.executable, "-c", "import threading, time; "
                              "threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"],
                             start_new_session=own_session)
        procs.append(p)
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{p.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # until its second thread runs
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_session_leader_gets_the_value_for_its_autogroup_and_every_thread(child):
    pid = child(own_session=True)
    assert priority.apply(pid, 7) is None
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert tids and all(os.getpriority(os.PRIO_PROCESS, t) == 7 for t in tids)
    if autogroup_nice(pid) is not None:  # a kernel built with autogroups
        assert autogroup_nice(pid) == 7


def test_a_process_in_someone_elses_session_leaves_that_sessions_autogroup_alone(child):
    mine = autogroup_nice(os.getpid())
    pid = child(own_session=False)
    assert priority.apply(pid, 5) is None
    assert os.getpriority(os.PRIO_PROCESS, pid) == 5
    assert autogroup_nice(os.getpid()) == mine  # the test runner's (the shell's) group is not the child's to change


def test_a_refused_raise_says_so_and_what_it_needs(child, monkeypatch):
    pid = child(own_session=False)

    def refuse(which, who, value):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    why = priority.apply(pid, -10)
    assert why is not None and "permission denied" in why and "CAP_SYS_NICE" in why


def test_a_process_that_is_gone_is_reported_not_raised():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert "process" in (priority.apply(gone.pid, 3) or "")


def test_the_local_stack_starts_a_server_at_its_priority_in_a_session_of_its_own(tmp_path):
    from mmstream.localstack import procs

    pid = procs.start_detached(["sleep", "30"], tmp_path / "sleep.log", cwd=tmp_path, nice=4)
    try:
        assert os.getsid(pid) == pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == 4
        if autogroup_nice(pid) is not None:
            assert autogroup_nice(pid) == 4
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_move_keeps_each_threads_offset_from_the_main_thread(child):
    pid = child(own_session=True)
    assert priority.apply(pid, 2) is None
    main, *others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    os.setpriority(os.PRIO_PROCESS, others[0], 9)  # a thread its engine runs lower
    assert priority.move(pid, 5) is None
    assert os.getpriority(os.PRIO_PROCESS, main) == 5 and os.getpriority(os.PRIO_PROCESS, others[0]) == 12
    if autogroup_nice(pid) is not None:
        assert autogroup_nice(pid) == 5


@pytest.mark.skipif(os.geteuid() != 0, reason="taking a raise back needs root or CAP_SYS_NICE")
def test_a_raise_is_given_back_past_capacity_and_taken_again_after_the_hold(child):
    from streams.policies.step_back import StepBack

    pid = child(own_session=True)
    assert priority.apply(pid, -5) is None
    now, heard = [0.0], []
    held = priority.Raise(-5, StepBack(rate_per_s=2, hold_s=1), heard.append, clock=lambda: now[0], pid=pid)
    held.refused()
    held.update()
    assert heard == [] and os.getpriority(os.PRIO_PROCESS, pid) == -5  # one refusal is not the rate
    held.refused()
    held.update()
    assert heard == [0] and os.getpriority(os.PRIO_PROCESS, pid) == 0
    if autogroup_nice(pid) is not None:
        assert autogroup_nice(pid) == 0
    now[0] = 1.0
    held.update()
    assert heard == [0, -5] and os.getpriority(os.PRIO_PROCESS, pid) == -5


def test_only_a_process_that_runs_raised_holds_a_raise():
    from streams.policies.step_back import StepBack

    policy = StepBack(rate_per_s=5, hold_s=5)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority.Raise.held(3, policy, print) is None  # a lowering is not a raise
    assert priority.Raise.held(mine - 1 if mine > -20 else mine + 1, policy, print) is None  # not what it runs at


@pytest.mark.skipif(os.geteuid() != 0, reason="coming back from a lowering needs root or RLIMIT_NICE")
def test_a_generator_runs_lower_while_it_holds_background_work_and_comes_back_without(child):
    pid = child(own_session=True)
    assert priority.apply(pid, 1) is None
    lowered = priority.Lowered(1, 10, pid=pid)
    main, *_ = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    lowered.hold(0)
    assert os.getpriority(os.PRIO_PROCESS, main) == 1  # nothing held: as it was
    lowered.hold(2)
    assert os.getpriority(os.PRIO_PROCESS, main) == 11 and lowered.down
    if autogroup_nice(pid) is not None:
        assert autogroup_nice(pid) == 11
    lowered.hold(1)
    lowered.hold(0)
    assert os.getpriority(os.PRIO_PROCESS, main) == 1 and not lowered.down


def test_lowering_moves_only_on_a_change_and_not_at_all_where_it_could_not_come_back(monkeypatch):
    moves: list[int] = []
    shown: list[int] = []
    lowered = priority.Lowered(0, 10, pid=1, mover=lambda pid, nice: moves.append(nice), on_move=shown.append)
    for held in (0, 1, 3, 2, 0, 0, 1):
        lowered.hold(held)
    assert moves == shown == ([10, 0, 10] if lowered.enabled else [])
    monkeypatch.setattr(priority, "_may_return_to", lambda nice: False)
    stuck = priority.Lowered(0, 10, pid=1, mover=lambda pid, nice: moves.append(nice))
    stuck.hold(1)
    assert not stuck.enabled and not stuck.down
    assert not priority.Lowered(0, 0, pid=1).enabled  # debt_nice 0: off
