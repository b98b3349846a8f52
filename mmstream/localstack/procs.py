"""Process plumbing for the local stack: pid files, liveness, ports, stopping, tools.

Everything here is synchronous and Linux-first (it reads ``/proc`` where that helps tell
our process from a stranger that reused its pid) and degrades to plain ``kill(pid, 0)``
elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from streams.runtime import priority


class LocalStackError(RuntimeError):
    """A local broker or cache could not be installed, started or stopped; the message says what to do."""


# Children we spawned in this interpreter. Holding the Popen objects keeps Python from
# warning about (or reaping) them behind our back, and lets is_alive() see a child that
# exited but was not yet waited for, which kill(pid, 0) would report as alive.
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class PidRecord:
    """What a pid file holds: the pid, its start time (to detect pid reuse), and extras."""

    pid: int
    started: int | None  # /proc start time in clock ticks; None where /proc is absent
    extra: dict[str, Any] = field(default_factory=dict)

    def is_running(self) -> bool:
        """True while the recorded process, and not a later one with its pid, is alive."""
        return is_alive(self.pid, self.started)


def write_pid_file(path: Path, pid: int, **extra: Any) -> PidRecord:
    """Record ``pid`` (and its start time) in ``path`` atomically; return the record."""
    record = PidRecord(pid, _start_ticks(pid), dict(extra))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": pid, "started": record.started, **extra}))
    tmp.replace(path)
    return record


def read_pid_file(path: Path) -> PidRecord | None:
    """The record in ``path``, or None when the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        pid = int(data.pop("pid"))
        started = data.pop("started", None)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return PidRecord(pid, started, data)


def start_detached(argv: Sequence[str], log_file: Path, cwd: Path, nice: int = 0) -> int:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log_file``, at
    CPU priority ``nice`` (``streams.runtime.priority``; a warning where it cannot be set).

    Its own session means Ctrl-C in the terminal that ran `mmstream up` does not reach it,
    and it outlives the CLI. Returns the pid. Raises LocalStackError if it cannot be exec'd.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        try:
            proc = subprocess.Popen(
                list(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )
        except OSError as exc:
            raise LocalStackError(f"Could not start {argv[0]}: {exc}") from None
    _children[proc.pid] = proc
    if nice:  # Popen returned after the exec: the child is in its own session by now
        priority.apply_logged(Path(argv[0]).name, proc.pid, nice)
    return proc.pid


def is_alive(pid: int, started: int | None = None) -> bool:
    """True if ``pid`` runs and is not a zombie; with ``started``, also that it is the same process."""
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: kill(pid, 0) is all we can know
    if stat[0] == "Z":
        return False
    return started is None or _ticks(stat) == started


def is_port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections on ``host:port`` within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    """True if ``host`` names this machine's loopback interface, the only place we start servers."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def terminate(pid: int, grace_s: float, started: int | None = None) -> bool:
    """Stop ``pid``: SIGTERM, wait up to ``grace_s`` seconds, then SIGKILL.

    Returns True if it exited within the grace period, False if it had to be killed.
    Returns True at once if the process is already gone (or, with ``started``, if the pid
    now belongs to another process, which is left alone).
    """
    if not is_alive(pid, started):
        return True
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_alive(pid):
            _reap(pid)
            return True
        time.sleep(0.1)
    _signal(pid, signal.SIGKILL)
    kill_deadline = time.monotonic() + 10  # SIGKILL cannot be refused; this only bounds /proc lag
    while is_alive(pid) and time.monotonic() < kill_deadline:
        time.sleep(0.05)
    _reap(pid)
    return False


def stop_recorded(pid_file: Path, lock_file: Path, grace_s: float) -> None:
    """Stop the process a pid file records (SIGTERM, SIGKILL after ``grace_s``) and remove
    the file, under the state lock; a missing file means nothing of ours runs."""
    with state_lock(lock_file):
        record = read_pid_file(pid_file)
        if record is not None:
            terminate(record.pid, grace_s, started=record.started)
            pid_file.unlink(missing_ok=True)


def require_tool(name: str, install_hint: str) -> str:
    """The path of executable ``name`` on PATH.

    Raises LocalStackError whose message is ``install_hint``: one sentence saying what needs
    the tool and how to install it, e.g. "Java 17+ is needed to run the local Kafka broker:
    apt-get install openjdk-17-jre-headless".
    """
    path = shutil.which(name)
    if path is None:
        raise LocalStackError(install_hint)
    return path


def run_tool(argv: Sequence[str], what: str, timeout_s: float, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> str:
    """Run ``argv`` to completion and return its stdout.

    ``what`` names the step for the error ("Formatting the Kafka data directory"). Raises
    LocalStackError with the last 20 lines of output if it fails or runs past ``timeout_s``.
    """
    try:
        done = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LocalStackError(f"{what} took longer than {timeout_s:.0f} s: {' '.join(argv)}") from None
    except OSError as exc:
        raise LocalStackError(f"{what} could not run {argv[0]}: {exc}") from None
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise LocalStackError(f"{what} failed (exit {done.returncode}):\n{output}")
    return done.stdout


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of text file ``path`` ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))  # 64 KiB holds 20 log lines with room to spare
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    child = _children.pop(pid, None)
    if child is not None:
        try:
            child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return raw[raw.rfind(")") + 2:].split()


def _ticks(stat: list[str]) -> int | None:
    try:
        return int(stat[19])  # field 22 of stat(5), counted from field 3
    except (IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else _ticks(stat)


@contextlib.contextmanager
def state_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the block.

    Two `mmstream up` at once would otherwise both see "nothing running" and start two
    servers on one state directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (created so from the start: it
    holds a password, a password hash or a private key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def kept_secret(path: Path) -> str:
    """The secret kept in ``path`` (mode 0600), made on first use (URL-safe, 32 characters)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: of two processes making it at once, one writes and both read that one
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
    for _ in range(100):  # the other writer may not have written yet
        text = path.read_text().strip()
        if text:
            return text
        time.sleep(0.01)
    raise LocalStackError(f"{path} is empty")
