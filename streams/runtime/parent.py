"""A worker that stops when the process that started it is gone (``local.parent_pid``).

`mmstream up`'s workers outlive the command that started them, and run until `mmstream down`.
A pipeline a bench (or a test) starts for itself is different: killed without its cleanup (a
SIGTERM, a SIGKILL, a CI job's timeout), it left its workers running, idle but heartbeating
and fetching, and they took CPU from every run after. Such a starter names itself in the
workers' environment; each worker then checks once a second that it is still that process's
child (a process whose parent died is handed to init or a subreaper, so ``getppid`` changes,
and a reused pid cannot become its parent again) and, when not, stops itself the way `mmstream
down` would: SIGTERM, so the stage drains and commits what it can, and SIGKILL if it has not
exited ``grace_s`` later (a graceful stop that hangs must not leave it running for good).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

PARENT_PID_ENV = "MMSTREAM_LOCAL_PARENT_PID"
"""``local.parent_pid``: what a process starting a pipeline for itself puts in its workers'
environment (``mmstream.supervisor.Supervisor`` then names itself there for each worker it starts)."""
CHECK_INTERVAL_S = 1.0
GRACE_S = 30.0
"""As long as `mmstream down` waits for a worker before SIGKILL (``Supervisor.stop_one``)."""


def _signal_self(sig: int) -> Callable[[], None]:
    return lambda: os.kill(os.getpid(), sig)


def stop_with_parent(parent_pid: int, getppid: Callable[[], int] = os.getppid,
                     stop: Callable[[], None] = _signal_self(signal.SIGTERM),
                     force: Callable[[], None] | None = _signal_self(signal.SIGKILL),
                     interval_s: float = CHECK_INTERVAL_S, grace_s: float = GRACE_S) -> threading.Event | None:
    """Watch, in a daemon thread, that ``parent_pid`` is this process's parent; once it is not
    (at once, if it already is not), call ``stop``, then ``force`` if this process still runs
    ``grace_s`` later. Returns an event that ends the watch when set; None (nothing watched)
    for ``parent_pid`` 0."""
    if parent_pid <= 0:
        return None
    done = threading.Event()

    def watch() -> None:
        while getppid() == parent_pid:
            if done.wait(interval_s):
                return
        log.warning("the process that started this worker (pid %d) is gone: stopping", parent_pid)
        stop()
        if force is not None and not done.wait(grace_s):
            log.error("still running %.0f s after SIGTERM: killing this worker", grace_s)
            force()

    threading.Thread(target=watch, name="mmstream-parent", daemon=True).start()
    return done
