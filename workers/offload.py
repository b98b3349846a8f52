"""A process of its own, at low CPU priority, for preparation one request can make long: a
picture at the pixel bound takes a core for a fifth of a second to decode, and a tenant may
send sixteen of them in one request, priced and admitted.

Why a process and not a thread: the kernel shares the cores between sessions first
(autogroups) or between cgroups, and only then between the threads inside one by their nice
values. A low-priority thread inside the image encoder still takes the encoder's whole share
of the box from every other process: the router encoding another tenant's texts waits for
a core all the same. This process starts a session of its own (``os.setsid``) and sets that
session's autogroup, and itself, to ``nice``: against every other process of the pipeline it
then gets what they leave (at 19, about 1.5% of a core they all want, all of an idle one).
Lowering a priority needs no privilege. Where a cgroup holds the worker (a container), the
nice value still orders it behind the worker's own threads in the same cgroup.

It also keeps a decode that brings its process down (a decoder's crash, the kernel's OOM
killer) away from the worker: the call fails with ``OffloadDied`` and the next call starts a
new process. The process dies with its worker (``PR_SET_PDEATHSIG``). One process, one call
at a time: the caller's heavy thread takes turns already (``streams.cores.encoder``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


class OffloadDied(RuntimeError):
    """The offload process ended during the call (its work killed it, or it was killed)."""


class Offload:
    """Calls run in one spawned process at CPU priority ``nice`` (see the module docstring)."""

    def __init__(self, nice: int = 19) -> None:
        self.nice = nice
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the offload process (both picklable); raises what ``fn`` raises,
        or ``OffloadDied``."""
        pool = self._current()
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool as exc:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
                    self.restarts += 1
            pool.shutdown(wait=False, cancel_futures=True)
            log.warning("the offload process died during %s; the next call starts another",
                        getattr(fn, "__name__", fn))
            raise OffloadDied("the process preparing it died (out of memory, or a decoder's crash)") from exc

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _current(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"), initializer=enter_background,
                    initargs=(self.nice,))
            return self._pool


def enter_background(nice: int) -> None:
    """Process initializer: die with the parent, lead a session (an autogroup) of its own,
    and run it and this process at ``nice``. What cannot be set is logged, never raised (the
    work still runs, at the default priority)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the call above
            os._exit(0)
        os.setsid()
    except OSError as exc:
        log.info("offload: no session of its own: %r", exc)
    for attempt in range(3):  # unprivileged, the kernel takes ten autogroup changes a second
        try:
            with open("/proc/self/autogroup", "w") as group:
                group.write(str(nice))
            break
        except BlockingIOError:
            threading.Event().wait(0.1)
        except OSError as exc:  # no autogroups (a cgroup decides): the nice value below still counts
            log.info("offload: autogroup not set: %r", exc)
            break
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        log.info("offload: nice %d not set: %r", nice, exc)
