"""A worker tied to the process that started it (``local.parent_pid``) stops once that process is
no longer its parent, and only then; one started by `mmstream up` (0) is never watched."""

from __future__ import annotations

import os
import threading

from mmstream.supervisor import PARENT_PID_ENV, Supervisor
from schemas.settings import Settings
from streams.runtime.parent import stop_with_parent


def _watch(parents: list[int], pid: int) -> tuple[threading.Event, threading.Thread | None]:
    """Watch ``pid`` while this process's parent is each of ``parents`` in turn (the last one for ever)."""
    stopped = threading.Event()
    seen = iter(parents)
    last = [parents[-1]]

    def getppid() -> int:
        last[0] = next(seen, last[0])
        return last[0]

    return stopped, stop_with_parent(pid, getppid=getppid, stop=stopped.set, interval_s=0.005)


def test_a_worker_stops_once_its_starter_is_no_longer_its_parent() -> None:
    stopped, thread = _watch([4242, 4242, 4242, 1], 4242)  # reparented to init on the fourth look
    assert thread is not None and stopped.wait(5)
    thread.join(5)
    assert not thread.is_alive()


def test_a_worker_whose_starter_lives_keeps_running() -> None:
    stopped, thread = _watch([4242], 4242)
    assert thread is not None and not stopped.wait(0.2)


def test_a_worker_started_after_its_starter_died_stops_at_once() -> None:
    stopped, _ = _watch([1], 4242)  # the starter died before the worker looked
    assert stopped.wait(5)


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
