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
- ``by_kind``: per request kind sent in the window, its median and slowest wait beside the
  kind's median before any fault (a Redis outage should cost a text request at most 2x);
- ``cpu``: who had the machine's CPU from the fault's start to that first answer (busy in all,
  the workers, the run's own brokers), from ``cpu.json``;
- ``first_answer_after_s``: when the first request sent after the fault started was answered;
- ``back_to_normal_s``: when requests sent from then on are answered within twice the run's
  latency before any fault (the p99 of requests answered before the first fault began).

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
"""The CLI's layout, before Faust's worker starts: ``%(asctime)s %(levelname)s %(name)s: %(message)s``."""
FAUST_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] \[\d+\] \[(\w+)\] ()(.*)$")
"""Faust's layout once its worker runs: ``[asctime] [pid] [LEVEL] message`` (no logger name)."""
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
            m = LINE.match(line) or FAUST_LINE.match(line)
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


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _cpu_share(cpu: list[dict[str, Any]], begin: float, end: float) -> dict[str, float] | None:
    """Shares of the machine's CPU (all cores = 1) between ``begin`` and ``end``: busy in all,
    and taken by the workers and by the run's own brokers (per process, so a broker or worker
    started meanwhile counts from its start); None without two samples there."""
    inside = [c for c in cpu if begin - 1.0 <= c["at"] <= end + 1.0]
    if len(inside) < 2:
        return None
    a, b = inside[0], inside[-1]
    total = b["machine_total"] - a["machine_total"]
    if total <= 0:
        return None

    def used(group: str) -> float:
        last: dict[str, float] = {}
        first: dict[str, float] = {}
        for c in inside:
            for pid, s in c[group].items():
                first.setdefault(pid, s if c is a else 0.0)
                last[pid] = s
        return sum(max(0.0, last[p] - first[p]) for p in last)

    return {"seconds": round(b["at"] - a["at"], 1), "busy": round((b["machine_busy"] - a["machine_busy"]) / total, 2),
            "workers": round(used("workers") / total, 2), "brokers": round(used("brokers") / total, 2)}


def breakdown(root: Path) -> list[dict[str, Any]]:
    """Per fault of the run kept in ``root``: see the module docstring."""
    faults = json.loads((root / "faults.json").read_text())
    requests = [r for r in json.loads((root / "requests.json").read_text()) if r.get("sent")]
    cpu_file = root / "cpu.json"
    cpu = json.loads(cpu_file.read_text()) if cpu_file.exists() else []
    events = sorted(read_events(root / "state" / "workers") + read_broker_events(root), key=lambda e: e.at)
    first = min((f["begin"] for f in faults), default=None)
    before = [r["answered"] - r["sent"] for r in requests if r["answered"] and first and r["answered"] < first]
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
        by_kind: dict[str, dict[str, Any]] = {}
        for kind in sorted({r["kind"] for r in inside}):
            mine = [r["answered"] - r["sent"] for r in inside if r["kind"] == kind and r["answered"]]
            usual = [r["answered"] - r["sent"] for r in requests
                     if r["kind"] == kind and r["answered"] and first and r["answered"] < first]
            by_kind[kind] = {"requests": len(mine), "max_s": round(max(mine), 2) if mine else None,
                             "p50_s": _round(_median(mine)), "p50_before_faults_s": _round(_median(usual))}
        dark_end = begin + (first_answer - begin if first_answer is not None else end - begin)
        cpu_share = _cpu_share(cpu, begin, max(dark_end, end))
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
            "by_kind": by_kind,
            "cpu": cpu_share,
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
        if p.get("cpu"):
            c = p["cpu"]
            print(f"  CPU over {c['seconds']} s from the fault to the first answer: machine {c['busy']:.0%} busy, "
                  f"workers {c['workers']:.0%}, own brokers {c['brokers']:.0%} (all cores = 100%)")
        for kind, k in p["by_kind"].items():
            print(f"  {kind:6s} sent in the window: {k['requests']}, p50 {k['p50_s']} s, max {k['max_s']} s "
                  f"(p50 before any fault {k['p50_before_faults_s']} s)")
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
