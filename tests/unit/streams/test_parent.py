"""A worker tied to the process that started it (``local.parent_pid``) stops once that process is
no longer its parent, and only then; one started by `mmstream up` (0) is never watched."""

from __future__ import annotations

import os
import threading

from mmstream.supervisor import Supervisor
from schemas.settings import Settings
from streams.runtime.parent import PARENT_PID_ENV, stop_with_parent


class _Watched:
    """A watch of pid 4242 while this process's parent is each of ``parents`` in turn (the last
    one for ever), with what it did: stopped, then forced if still running."""

    def __init__(self, parents: list[int], grace_s: float = 30.0) -> None:
        self.stopped, self.forced = threading.Event(), threading.Event()
        seen, last = iter(parents), [parents[-1]]

        def getppid() -> int:
            last[0] = next(seen, last[0])
            return last[0]

        self.cancel = stop_with_parent(4242, getppid=getppid, stop=self.stopped.set, force=self.forced.set,
                                       interval_s=0.005, grace_s=grace_s)


def test_a_worker_stops_once_its_starter_is_no_longer_its_parent() -> None:
    w = _Watched([4242, 4242, 4242, 1])  # reparented to init on the fourth look
    assert w.stopped.wait(5)
    assert not w.forced.wait(0.1)  # it gets its grace to stop
    w.cancel.set()


def test_a_worker_still_running_after_its_grace_is_killed() -> None:
    w = _Watched([1], grace_s=0.05)
    assert w.stopped.wait(5) and w.forced.wait(5)


def test_a_worker_whose_starter_lives_keeps_running() -> None:
    w = _Watched([4242])
    assert not w.stopped.wait(0.2)
    w.cancel.set()


def test_a_worker_started_after_its_starter_died_stops_at_once() -> None:
    w = _Watched([1])  # the starter died before the worker looked
    assert w.stopped.wait(5)
    w.cancel.set()


def test_a_worker_of_mmstream_up_is_not_watched() -> None:
    assert stop_with_parent(0) is None
    assert Settings.from_env({}).local.parent_pid == 0


def test_a_supervisor_ties_the_workers_it_starts_to_itself_only_when_it_was_asked_to(tmp_path) -> None:
    """A tied pipeline's workers are tied to the process that starts them: the bench's, or the
    local scaler's (itself a worker the bench tied), so a chain stops together."""
    settings = Settings.from_env({"MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    tied = Supervisor(settings, env={PARENT_PID_ENV: "1"})._env(0)  # noqa: SLF001
    free = Supervisor(settings, env={})._env(0)  # noqa: SLF001
    assert tied[PARENT_PID_ENV] == str(os.getpid())
    assert PARENT_PID_ENV not in free
