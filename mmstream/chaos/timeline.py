"""Where a fault's seconds go: the run's faults, its requests and its workers' logs on one
clock, each fault's recovery cut into phases.

The runner writes ``faults.json`` (each fault's wall-clock window) and ``requests.json``
(each request's kind, lane, send and answer times) into the run's folder; the workers write
their logs under ``state/workers/<prefix>/``. ``breakdown(root)`` reads them back and says,
per fault, relative to its start (seconds):

- ``stalled``: requests sent in the window and how long the slowest waited;
- ``events``: the first and last time each kind of recovery step shows in any worker's (or
  the run's own broker's) log until the next fault (a member
  leaving the group, a rebalance starting, partitions assigned, a take-over's replay,
  producer retries, the broker or Redis seen away and back), with the worker that said it;
- ``first_answer_after_s``: when the first request sent after the fault started was answered;
- ``back_to_normal_s``: when requests sent from then on are answered within twice the run's
  latency before any fault (the p99 of requests sent before the first fault).

`python -m mmstream.chaos.timeline DIR` prints it for a run kept with ``--workdir``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\w+) ([\w.]+): (.*)$")
BROKER_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] (\w+) (.*)$")
"""infra/kafka/log4j2.xml's layout: ``[%d] %p %m (%c)``."""
BROKER_EVENTS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("broker started", r"Kafka Server started"),
    ("broker fenced", r"[Ff]encing broker|session has timed out|has been fenced"),
    ("broker shutting down", r"shutting down|Shutting down"),
))

EVENTS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern)) for name, pattern in (
    ("heartbeat failed", r"Heartbeat (failed|session expired|send request failed)"),
    ("coordinator lost", r"Marking the coordinator dead|marking coordinator dead"),
    ("coordinator found", r"Discovered coordinator"),
    ("revoking", r"Revoking previously assigned partitions"),
    ("joining", r"\(Re-\)joining group"),
    ("joined", r"Joined group"),
    ("assigned", r"Setting newly assigned partitions"),
    ("replay", r"requests to replay"),
    ("output retry", r"outputs not delivered; retry"),
    ("output held", r"ownership in doubt"),
    ("output released", r"ownership confirmed"),
    ("commit skipped", r"commit skipped|OffsetCommit failed"),
    ("poll failed", r"poll failed"),
    ("broker unreachable", r"Unable connect|Unable to update metadata|Connection .* refused|NodeNotReady"
                           r"|KafkaConnectionError|Unable to request metadata"),
    ("cache bypassed", r"bypassing the cache|result cache unavailable"),
    ("redis error", r"Redis|redis"),
))


@dataclass(frozen=True)
class LogEvent:
    at: float
    """Wall-clock seconds."""
    worker: str
    kind: str
    text: str


def _wall(date: str, millis: str) -> float:
    return time.mktime(time.strptime(date, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000.0


def read_events(log_dir: Path) -> list[LogEvent]:
    out: list[LogEvent] = []
    for log in sorted(log_dir.glob("**/*.log")):
        worker = log.stem
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = LINE.match(line)
            if not m:
                continue
            for kind, pattern in EVENTS:
                if pattern.search(m.group(5)):
                    out.append(LogEvent(_wall(m.group(1), m.group(2)), worker, kind, m.group(5)[:160]))
                    break
    out.sort(key=lambda e: e.at)
    return out


def read_broker_events(root: Path) -> list[LogEvent]:
    out: list[LogEvent] = []
    for log in sorted(root.glob("kafka-*/broker.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = BROKER_LINE.match(line)
            if not m:
                continue
            for kind, pattern in BROKER_EVENTS:
                if pattern.search(m.group(4)):
                    out.append(LogEvent(_wall(m.group(1), m.group(2)), log.parent.name, kind, m.group(4)[:160]))
                    break
    return out


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def breakdown(root: Path) -> list[dict[str, Any]]:
    """Per fault of the run kept in ``root``: see the module docstring."""
    faults = json.loads((root / "faults.json").read_text())
    requests = [r for r in json.loads((root / "requests.json").read_text()) if r.get("sent")]
    events = sorted(read_events(root / "state" / "workers") + read_broker_events(root), key=lambda e: e.at)
    first = min((f["begin"] for f in faults), default=None)
    before = [r["answered"] - r["sent"] for r in requests if r["answered"] and first and r["sent"] < first]
    normal = _p99(before)
    out = []
    for i, f in enumerate(faults):
        begin, end = f["begin"], f["end"]
        nxt = faults[i + 1]["begin"] if i + 1 < len(faults) else float("inf")
        inside = [r for r in requests if begin <= r["sent"] <= end]
        waits = [r["answered"] - r["sent"] for r in inside if r["answered"]]
        after = sorted((r for r in requests if r["sent"] >= begin and r["answered"]), key=lambda r: r["sent"])
        first_answer = min((r["answered"] for r in after), default=None)
        back = None
        if normal is not None:
            late = [r["sent"] for r in after if r["answered"] - r["sent"] > 2 * normal and r["sent"] < nxt]
            back = (max(late) - begin) if late else 0.0
        seen: dict[str, dict[str, Any]] = {}
        counts: dict[str, int] = {}
        for e in events:
            if begin - 0.5 <= e.at < min(nxt, end + 60):
                counts[e.kind] = counts.get(e.kind, 0) + 1
                seen.setdefault(e.kind, {"at_s": round(e.at - begin, 2), "worker": e.worker, "text": e.text})
                seen[e.kind]["last_at_s"] = round(e.at - begin, 2)
        out.append({
            "fault": f["fault"], "window_s": round(end - begin, 2),
            "stalled": {"requests": len(inside), "max_wait_s": round(max(waits), 2) if waits else None,
                        "unanswered": sum(1 for r in inside if not r["answered"])},
            "first_answer_after_s": None if first_answer is None else round(first_answer - begin, 2),
            "back_to_normal_s": None if back is None else round(back, 2),
            "normal_p99_s": None if normal is None else round(normal, 2),
            "events": dict(sorted(seen.items(), key=lambda kv: kv[1]["at_s"])),
            "event_counts": counts,
        })
    return out


def print_breakdown(parts: list[dict[str, Any]]) -> None:
    for p in parts:
        s = p["stalled"]
        print(f"== {p['fault']} (window {p['window_s']} s): {s['requests']} requests sent in it, slowest "
              f"{s['max_wait_s']} s, {s['unanswered']} unanswered; first answer after +{p['first_answer_after_s']} s; "
              f"back to normal (< 2x p99 before faults, {p['normal_p99_s']} s) from +{p['back_to_normal_s']} s")
        for kind, e in p["events"].items():
            n = p["event_counts"].get(kind, 1)
            print(f"  +{e['at_s']:7.2f} s .. +{e['last_at_s']:7.2f} s  {kind:20s} x{n:<4d} {e['worker']}: {e['text']}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mmstream.chaos.timeline RUN_DIR", file=sys.stderr)
        return 2
    print_breakdown(breakdown(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
