"""CPU priority of the local stack's processes (``local.nice``).

On a box the pipeline shares with its own heavy work, what decides an interactive request's
tail is whether the processes on its path get a core when a record arrives. On Linux the
scheduler shares the cores between sessions first (autogroups), and `mmstream up` starts the
broker, Redis and every worker in a session of its own: so under a flood each busy process
gets about an equal share, and the router, whose own encoder answers the short texts, waits
for a core behind the encoders decoding another tenant's megapixel images
(docs/isolation.md, "Stop 44"). A lower nice value for the processes every request passes
through (the router, the broker) lets them run first and leaves the heavy pools what they
leave. It is a trade: past capacity the router's work grows with what arrives, shed or not,
and ahead of the pools it takes the cores the admitted requests wait for; so a raised router
steps back while admission refuses for want of capacity (``Raise``, ``StepBack``), and with
that ``local.nice`` raises the router by default (``router=-10``, stop 56).

``apply`` sets both levers the kernel has: the process's autogroup nice value (what counts
between sessions; set only for a session's leader, as `mmstream up` starts them, never for a
shell's session) and each of its threads' own nice value (what counts where no autogroup
applies: the process runs in a cgroup with the cpu controller, or the kernel has none). A
thread started later inherits its creator's value, so a worker applies its own at start,
before its engine threads exist, and the relative lowering of its heavy threads
(``encoder.heavy_prep_nice``, ``router.colocate_nice``) still holds on top of it.

A raised router does not keep its raise past the box's capacity: ``Raise`` moves it back to
0 (``move``, which keeps each thread's offset) while admission refuses requests for want of
capacity, and up again after a hold, as ``streams.policies.step_back`` decides.

Raising a priority (a negative value) needs root or ``CAP_SYS_NICE``: without them nothing is
changed and ``apply`` says so (a warning, never a failure). In containers, give the same
intent through the orchestrator (CPU shares or weights per service).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from streams.policies.step_back import StepBack

log = logging.getLogger(__name__)


def apply(pid: int, nice: int, proc: Path = Path("/proc")) -> str | None:
    """Run process ``pid`` at CPU priority ``nice``: its autogroup's nice value and each of
    its threads'. None when both are set (or the system has neither: not Linux); otherwise
    why not, with what could be set left set."""
    return _set(pid, nice, proc, keep_offsets=False)


def move(pid: int, nice: int, proc: Path = Path("/proc")) -> str | None:
    """Move running process ``pid`` to CPU priority ``nice``, as ``apply`` does, but keeping
    each thread's offset from the process's main thread: a thread its engine runs lower
    (``encoder.heavy_prep_nice``, ``router.colocate_nice``) stays that much lower. None when
    done; otherwise why not."""
    return _set(pid, nice, proc, keep_offsets=True)


def _set(pid: int, nice: int, proc: Path, keep_offsets: bool) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    problems: list[str] = []
    group = proc / str(pid) / "autogroup"
    # Only a session's leader speaks for its autogroup: a worker run by hand from a shell
    # shares the shell's, which is not this process's to change.
    if group.exists() and _leads_session(pid):
        try:
            group.write_text(str(nice))
        except OSError as exc:
            problems.append(f"its autogroup: {exc.strerror or exc}")
    try:
        tids = [int(t) for t in os.listdir(proc / str(pid) / "task")]
        delta = nice - os.getpriority(os.PRIO_PROCESS, pid) if keep_offsets else 0
    except OSError as exc:
        return f"process {pid}: {exc.strerror or exc}"
    refused = 0
    for tid in tids:
        try:
            value = min(19, max(-20, os.getpriority(os.PRIO_PROCESS, tid) + delta)) if keep_offsets else nice
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except PermissionError:
            refused += 1
    if refused:
        problems.append(f"{refused} of its {len(tids)} threads: permission denied")
    if not problems:
        return None
    hint = " (a raise needs root or CAP_SYS_NICE)" if nice < 0 else ""
    return f"nice {nice} not set on " + "; ".join(problems) + hint


def _leads_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def apply_logged(what: str, pid: int, nice: int) -> None:
    """``apply``, and a warning naming ``what`` when it could not."""
    why = apply(pid, nice)
    if why is not None:
        log.warning("%s runs at its default CPU priority: %s", what, why)


class Raise:
    """This process's raised priority, given back and taken again as ``policy`` says (the
    router's: ``streams.policies.step_back``). ``on_change`` hears each level it moves to."""

    def __init__(self, nice: int, policy: StepBack, on_change: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic, pid: int | None = None) -> None:
        self.nice, self.policy, self.on_change, self.clock = nice, policy, on_change, clock
        self.pid = os.getpid() if pid is None else pid

    @classmethod
    def held(cls, nice: int, policy: StepBack, on_change: Callable[[int], None]) -> Raise | None:
        """The raise this process runs at, when it runs raised at ``nice`` now (its worker
        applied ``local.nice`` at start); None otherwise: not raised, or the raise was refused,
        or a process that runs a stage in-process (a test, a bench) and is not ours to move."""
        if nice >= 0 or not sys.platform.startswith("linux") or os.getpriority(os.PRIO_PROCESS, 0) != nice:
            return None
        return cls(nice, policy, on_change)

    def refused(self) -> None:
        """A request refused for want of capacity."""
        self.policy.refused(self.clock())

    def update(self) -> None:
        """Move to the level the policy says now, if that changed."""
        raised = self.policy.update(self.clock())
        if raised is None:
            return
        level = self.nice if raised else 0
        why = move(self.pid, level)
        if why is not None:
            log.warning("could not move this process to CPU priority %d: %s", level, why)
        self.on_change(level)


class Lowered:
    """A process run ``by`` lower than its level ``base`` while it holds background work (work
    admitted over its tenant's compute bucket: the generator while it runs such a generation, a
    pool while its engine runs a batch of nothing else), and back at ``base`` when it holds none.
    A move only on a change, so a step costs nothing.

    Coming back up needs root, or an ``RLIMIT_NICE`` that allows ``base``: where it would not
    be allowed the process is never lowered (lowered for good, it would slow every tenant's
    work after the first such generation) and says so once."""

    def __init__(self, base: int, by: int, pid: int | None = None,
                 mover: Callable[[int, int], str | None] = move,
                 on_move: Callable[[int], None] = lambda nice: None) -> None:
        self.base, self.by, self.mover, self.on_move = base, by, mover, on_move
        self.pid = os.getpid() if pid is None else pid
        self.down = False
        self.enabled = by > 0 and sys.platform.startswith("linux") and _may_return_to(base)
        if by > 0 and not self.enabled:
            log.warning("work admitted in debt runs at this process's own priority: coming back to nice %d after "
                        "it would need root or RLIMIT_NICE", base)

    def hold(self, background: int) -> None:
        """Hold ``background`` units of background work now (0: none)."""
        want = self.enabled and background > 0
        if want == self.down:
            return
        self.down = want
        target = min(19, self.base + self.by) if want else self.base
        why = self.mover(self.pid, target)
        if why is not None:
            log.warning("could not move to nice %d: %s", target, why)
        self.on_move(target)  # what it runs at (the metric ``mmstream_cpu_nice``)


def _may_return_to(nice: int) -> bool:
    """Whether this process may set its nice value back down to ``nice``."""
    if os.geteuid() == 0:
        return True
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice
