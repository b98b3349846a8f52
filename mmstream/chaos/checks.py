"""The invariants a chaos run must hold afterwards, each read from the system itself:

- every request sent has exactly one terminal event on its reply topic, read from the topic
  (not through the SDK, which deduplicates) — none is lost, none is answered twice;
- no ``accepted`` and no token ``seq`` of a request appears twice on the topic;
- every terminal error carries a code the scenario allows (a fault may cost a deadline);
- every consumer group of the pipeline has committed up to the end of its topics (lag 0);
- the assembler's and the generator's state is empty once retention passed
  (``mmstream_state_entries`` and ``mmstream_inflight`` scraped from every worker);
- the dead-letter topic holds exactly the records the scenario expects;
- no worker's resident memory passed the stated cap (sampled during the run).
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from mmstream.supervisor import Supervisor
from schemas.codec import unpack
from schemas.events import Event
from streams.observe.topic_reader import read_to_end


@dataclass
class Wire:
    """What the reply topic says about the run's requests."""

    terminals: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    tokens: Counter = field(default_factory=Counter)
    """(id, seq) -> how many token events."""
    errors: Counter = field(default_factory=Counter)
    """error code -> terminal error events."""
    where: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """(id, seq) -> where each of its token events is (partition@offset and broker time)."""


async def read_wire(bootstrap: str, topic: str, ids: set[str]) -> Wire:
    wire = Wire()
    for record in await read_to_end(bootstrap, topic):
        try:
            ev = Event.from_wire(unpack(record.value))
        except Exception:
            continue
        if ev.id not in ids:
            continue
        if ev.terminal:
            wire.terminals[ev.id] += 1
            if ev.error:
                wire.errors[str(ev.error.get("code"))] += 1
        elif ev.kind == "accepted":
            wire.accepted[ev.id] += 1
        elif ev.kind == "token":
            wire.tokens[(ev.id, ev.seq)] += 1
            wire.where.setdefault((ev.id, ev.seq), []).append(
                f"[{record.partition}]@{record.offset} t={record.timestamp % 100_000}")
    return wire


def wire_violations(wire: Wire, ids: list[str], allowed_errors: tuple[str, ...]) -> tuple[list[str], int, int]:
    """(violations, lost, duplicated terminal events)."""
    out = []
    lost = [i for i in ids if wire.terminals[i] == 0]
    twice = [i for i in ids if wire.terminals[i] > 1]
    if lost:
        out.append(f"{len(lost)} requests got no terminal event (e.g. {lost[0]})")
    if twice:
        out.append(f"{len(twice)} requests got more than one terminal event (e.g. {twice[0]})")
    acc = [i for i, n in wire.accepted.items() if n > 1]
    if acc:
        out.append(f"{len(acc)} requests got `accepted` more than once (e.g. {acc[0]})")
    tok = [k for k, n in wire.tokens.items() if n > 1]
    if tok:
        where = wire.where.get(tok[0])
        at = f" at {', '.join(where)}" if where else ""
        out.append(f"{len(tok)} token events repeated a (request, seq) (e.g. {tok[0]}{at})")
    bad = {c: n for c, n in wire.errors.items() if c not in allowed_errors}
    if bad:
        out.append(f"terminal errors the scenario does not allow: {bad}")
    return out, len(lost), sum(n - 1 for n in wire.terminals.values() if n > 1)


async def group_lag(bootstrap: str, prefix: str, security: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Uncommitted records per consumer group of the pipeline (``<prefix>-<stage>``);
    ``security``: the clients' options (``streams.connection.client_kwargs``)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **dict(security or {}))
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, **dict(security or {}))
    await admin.start()
    await consumer.start()
    try:
        groups = [g[0] if isinstance(g, tuple) else g.group_id for g in await admin.list_consumer_groups()]
        lag: dict[str, int] = {}
        for group in sorted(g for g in groups if g.startswith(f"{prefix}-")):
            offsets = await admin.list_consumer_group_offsets(group)
            tps = [tp for tp in offsets if isinstance(tp, TopicPartition)]
            if not tps:
                continue
            ends = await consumer.end_offsets(tps)
            lag[group] = sum(max(0, ends[tp] - offsets[tp].offset) for tp in tps if offsets[tp].offset >= 0)
        return lag
    finally:
        await consumer.stop()
        await admin.close()


async def wait_lag_drained(bootstrap: str, prefix: str, timeout_s: float,
                           security: Mapping[str, Any] | None = None) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        lag = await group_lag(bootstrap, prefix, security)
        if not any(lag.values()) or time.monotonic() >= deadline:
            return lag
        await asyncio.sleep(2.0)


def scrape_state(supervisor: Supervisor) -> dict[str, dict[str, float]]:
    """``worker -> {kind: entries}`` from each live worker's ``mmstream_state_entries`` and
    ``mmstream_inflight``."""
    out: dict[str, dict[str, float]] = {}
    for w in supervisor.workers():
        port = w.metrics_port
        if not (w.alive and port):
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:  # loopback
                text = resp.read().decode()
        except OSError:
            continue
        kinds: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "mmstream_state_entries":
                    kinds[s.labels["kind"]] = s.value
                elif s.name == "mmstream_inflight":
                    kinds["inflight"] = kinds.get("inflight", 0) + s.value
        out[f"{w.stage}[{w.replica}]"] = kinds
    return out


async def wait_state_empty(supervisor: Supervisor, timeout_s: float) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = await asyncio.to_thread(scrape_state, supervisor)
        left = {w: {k: v for k, v in kinds.items() if v} for w, kinds in state.items()}
        left = {w: kinds for w, kinds in left.items() if kinds}
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(2.0)


async def dlq_count(bootstrap: str, topic: str) -> int:
    return len(await read_to_end(bootstrap, topic))


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


async def sample_rss(supervisor: Supervisor, peaks: dict[str, float], stop: asyncio.Event, every_s: float = 2.0) -> None:
    """Keep the highest RSS seen per worker in ``peaks`` until ``stop`` is set."""
    while not stop.is_set():
        for w in supervisor.workers():
            key = f"{w.stage}[{w.replica}]"
            peaks[key] = max(peaks.get(key, 0.0), rss_mb(w.pid))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def summarize_latency(sent: list[Any], windows: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(p99 e2e in ms of requests sent inside a fault window, seconds from the last window's
    end until every request sent before it was answered)."""
    sent = [s for s in sent if getattr(s, "sub", True) is not None]  # never produced: no one's to answer
    inside = [(s.answered_at - s.sent_at) * 1000 for s in sent if s.answered_at
              and any(a <= s.sent_at <= b for a, b in windows)]
    if not windows:
        return p99([(s.answered_at - s.sent_at) * 1000 for s in sent if s.answered_at]), None
    end = max(b for _, b in windows)
    before = [s for s in sent if s.sent_at <= end]
    if any(s.answered_at is None for s in before):
        return p99(inside), None
    last = max((s.answered_at for s in before), default=end)
    return p99(inside), max(0.0, last - end)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds ``pid`` has used (0 when it is gone)."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores together."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / tick, sum(values) / tick


async def sample_cpu(supervisor: Supervisor, broker_pids: Any, samples: list[dict[str, Any]], stop: asyncio.Event,
                     every_s: float = 1.0) -> None:
    """Append ``{"at": wall seconds, "machine_busy", "machine_total", "workers": {pid: s},
    "brokers": {pid: s}}`` (cumulative CPU seconds) to ``samples`` every ``every_s`` until
    ``stop`` is set: who had the CPU while a fault lasted (``timeline.py`` turns it into shares
    per fault). ``broker_pids``: a callable returning the pids of the run's own brokers."""
    while not stop.is_set():
        busy, total = machine_busy_seconds()
        samples.append({"at": time.time(), "machine_busy": busy, "machine_total": total,
                        "workers": {str(w.pid): cpu_seconds(w.pid) for w in supervisor.workers() if w.alive},
                        "brokers": {str(p): cpu_seconds(p) for p in broker_pids()}})
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def wait_workers_ready(supervisor: Supervisor, timeout_s: float) -> list[str]:
    """Wait until every live worker's ``/readyz`` answers 200 (engines loaded, clients
    started); returns the workers still not ready after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s

    def not_ready() -> list[str]:
        out = []
        for w in supervisor.workers():
            port = w.metrics_port
            try:
                if not (w.alive and port):
                    raise OSError("no port yet")
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:  # loopback
                    if resp.status == 200:
                        continue
            except OSError:
                pass
            out.append(f"{w.stage}[{w.replica}]")
        return out

    while True:
        left = await asyncio.to_thread(not_ready)
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.5)
