"""A worker that stops when the process that started it is gone (``local.parent_pid``).

`mmstream up`'s workers outlive the command that started them, and run until `mmstream down`.
A pipeline a bench (or a test) starts for itself is different: killed without its cleanup (a
SIGTERM, a SIGKILL, a CI job's timeout), it left its workers running, idle but heartbeating
and fetching, and they took CPU from every run after. Such a starter names itself in the
workers' environment; each worker then checks once a second that it is still that process's
child (a process whose parent died is handed to init or a subreaper, so ``getppid`` changes,
and a reused pid cannot become its parent again) and, when not, stops itself the way `mmstream
down` would: SIGTERM, so the stage drains and commits what it can.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


def stop_with_parent(parent_pid: int, getppid: Callable[[], int] = os.getppid,
                     stop: Callable[[], None] | None = None, interval_s: float = CHECK_INTERVAL_S) -> threading.Thread | None:
    """Watch, in a daemon thread, that ``parent_pid`` is this process's parent; once it is not
    (at once, if it already is not), call ``stop`` (default: SIGTERM to this process) and end.
    ``parent_pid`` 0: nothing is watched (None)."""
    if parent_pid <= 0:
        return None
    stop = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))
    done = threading.Event()

    def watch() -> None:
        while getppid() == parent_pid:
            if done.wait(interval_s):
                return
        log.warning("the process that started this worker (pid %d) is gone: stopping", parent_pid)
        stop()

    thread = threading.Thread(target=watch, name="mmstream-parent", daemon=True)
    thread.start()
    return thread
