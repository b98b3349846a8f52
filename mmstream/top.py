"""`mmstream top`: a live view of the running pipeline, refreshed every second.

Per topic: consumer lag (``streams.observe.lagmon``) and the in and out rates, from the deltas of
end offsets (records written) and committed offsets (records done) between two frames.
Per stage: p50/p95 queue and service time, batch size and items per second, estimated
from the histograms on each worker's /metrics (ports from the supervisor's pid files) the
way Prometheus' ``histogram_quantile`` does: linear within the bucket. Values cover the
last frame's interval when anything happened in it, else everything since the worker
started (marked ``all``). The stage with the highest p95 queue + service is highlighted.

Sampling (``sample``) does the I/O; ``stage_rows``, ``topic_rows`` and ``render`` are pure.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from mmstream.supervisor import Supervisor
from schemas.settings import Settings
from streams.observe.lagmon import LagReader, LagRow
from streams.connection import client_kwargs

QUEUE = "mmstream_stage_queue_seconds"
SERVICE = "mmstream_stage_service_seconds"
BATCH = "mmstream_batch_size"
HISTOGRAMS = (QUEUE, SERVICE, BATCH)

# bucket upper bound -> cumulative count, per histogram family
Buckets = dict[float, float]


@dataclass
class WorkerSample:
    """One scrape of one stage's workers, summed over replicas and labels."""

    stage: str
    workers: int
    alive: int
    histograms: dict[str, Buckets] = field(default_factory=dict)
    scraped: bool = False


@dataclass
class Sample:
    """Everything one frame needs, taken at ``at`` (monotonic seconds)."""

    at: float
    stages: dict[str, WorkerSample]
    lag: list[LagRow]


@dataclass(frozen=True)
class StageRow:
    stage: str
    workers: str
    """``alive/started`` workers of the stage."""
    window: str
    """``1s``-like when computed over the last interval, ``all`` since the workers started."""
    items_per_s: float | None
    queue_p50_ms: float | None
    queue_p95_ms: float | None
    service_p50_ms: float | None
    service_p95_ms: float | None
    batch_p50: float | None
    slowest: bool = False


@dataclass(frozen=True)
class TopicRow:
    topic: str
    lag: int
    in_per_s: float | None
    out_per_s: float | None


def quantile(q: float, buckets: Buckets, low: float = 0.0) -> float | None:
    """The ``q`` (0..1) quantile of a cumulative histogram, interpolated linearly inside its
    bucket (the lowest bucket from ``low``: 0 for times, 1 for batch sizes); the highest
    finite bound when it falls in +Inf; None for an empty histogram."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = low, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return prev_bound
            if count == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = b, count
    return prev_bound


def parse_histograms(text: str, names: Iterable[str] = HISTOGRAMS) -> dict[str, Buckets]:
    """Cumulative buckets of each named histogram in a /metrics exposition, summed over
    every label set (stage, modality, lane)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(names)
    out: dict[str, Buckets] = {n: defaultdict(float) for n in wanted}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out[family.name][float(s.labels["le"])] += s.value
    return {n: dict(b) for n, b in out.items()}


def _delta(now: Buckets, before: Buckets | None) -> Buckets:
    if not before:
        return dict(now)
    return {b: max(0.0, c - before.get(b, 0.0)) for b, c in now.items()}


def _total(b: Buckets) -> float:
    return b[max(b)] if b else 0.0


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def stage_rows(now: Sample, before: Sample | None) -> list[StageRow]:
    """One row per stage of ``now``; interval values when ``before`` is given and the stage
    did anything in between, cumulative ones otherwise. Marks the slowest stage."""
    dt = now.at - before.at if before else 0.0
    rows = []
    for stage in sorted(now.stages):
        ws = now.stages[stage]
        prev = before.stages.get(stage) if before else None
        hist = {n: _delta(ws.histograms.get(n, {}), prev.histograms.get(n) if prev else None) for n in HISTOGRAMS}
        window = f"{dt:.0f}s" if dt > 0 else "all"
        if _total(hist[SERVICE]) <= 0:  # idle in the interval: show what it did since it started
            hist, window = {n: dict(ws.histograms.get(n, {})) for n in HISTOGRAMS}, "all"
        rate = _total(hist[SERVICE]) / dt if window != "all" and dt > 0 else None
        rows.append(StageRow(
            stage=stage, workers=f"{ws.alive}/{ws.workers}", window=window if ws.scraped else "–",
            items_per_s=rate,
            queue_p50_ms=_ms(quantile(0.5, hist[QUEUE])), queue_p95_ms=_ms(quantile(0.95, hist[QUEUE])),
            service_p50_ms=_ms(quantile(0.5, hist[SERVICE])), service_p95_ms=_ms(quantile(0.95, hist[SERVICE])),
            batch_p50=quantile(0.5, hist[BATCH], low=1.0)))
    cost = {r.stage: (r.queue_p95_ms or 0.0) + (r.service_p95_ms or 0.0) for r in rows}
    if any(cost.values()):
        slowest = max(cost, key=lambda s: cost[s])
        rows = [StageRow(**{**r.__dict__, "slowest": r.stage == slowest}) for r in rows]
    return rows


def topic_rows(now: Sample, before: Sample | None) -> list[TopicRow]:
    """One row per consumed topic: total lag, records written and committed per second."""
    def totals(rows: Iterable[LagRow]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        lag: dict[str, int] = defaultdict(int)
        ends: dict[str, dict[int, int]] = defaultdict(dict)
        done: dict[str, int] = defaultdict(int)
        for r in rows:
            lag[r.topic] += r.lag
            ends[r.topic][r.partition] = r.end  # one end per partition, however many groups
            done[r.topic] += r.committed if r.committed is not None else 0
        return lag, {t: sum(p.values()) for t, p in ends.items()}, done

    lag, end, done = totals(now.lag)
    dt = now.at - before.at if before else 0.0
    if before is not None and dt > 0:
        _, end0, done0 = totals(before.lag)
    out = []
    for topic in sorted(lag):
        rate_in = rate_out = None
        if before is not None and dt > 0 and topic in end0:
            rate_in = max(0.0, end[topic] - end0[topic]) / dt
            rate_out = max(0.0, done[topic] - done0.get(topic, 0)) / dt
        out.append(TopicRow(topic, lag[topic], rate_in, rate_out))
    return out


def _num(x: float | None) -> str:
    """A number in at most 6 characters: one decimal under 100, none above."""
    if x is None:
        return "–"
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _pair(a: float | None, b: float | None) -> str:
    return "–" if a is None and b is None else f"{_num(a)}/{_num(b)}"


def render(now: Sample, before: Sample | None, prefix: str) -> Any:
    """The rich renderable of one frame; fits 80 columns (a test holds it to that)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    def table(title: str) -> Table:
        return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)

    topics = table(f"topics ({prefix}.*): lag in records, rates in records/s")
    for col in ("topic", "lag", "in/s", "out/s"):
        topics.add_column(col, justify="left" if col == "topic" else "right", no_wrap=True)
    for t in topic_rows(now, before):
        topics.add_row(t.topic, str(t.lag), _num(t.in_per_s), _num(t.out_per_s),
                       style="yellow" if t.lag > 0 else None)
    stages = table("stages: times in ms as p50/p95; slowest by p95 queue + service in red")
    for col in ("stage", "workers", "window", "items/s", "queue", "service", "batch"):
        stages.add_column(col, justify="left" if col == "stage" else "right", no_wrap=True)
    for r in stage_rows(now, before):
        stages.add_row(r.stage, r.workers, r.window, _num(r.items_per_s), _pair(r.queue_p50_ms, r.queue_p95_ms),
                       _pair(r.service_p50_ms, r.service_p95_ms), _num(r.batch_p50),
                       style="bold red" if r.slowest else None)
    return Group(topics, stages)


def frame_json(now: Sample, before: Sample | None, prefix: str, wall_time: float) -> str:
    """One frame as one line of JSON (``mmstream top --json``): the same rows as the tables,
    times in ms, rates per second, ``null`` where there is no value yet."""
    import dataclasses
    import json

    return json.dumps({
        "time": round(wall_time, 3), "prefix": prefix,
        "topics": [dataclasses.asdict(t) for t in topic_rows(now, before)],
        "stages": [dataclasses.asdict(r) for r in stage_rows(now, before)],
    }, separators=(",", ":"))


# -- sampling (I/O) ---------------------------------------------------------------------------


def _scrape(host: str, port: int, timeout_s: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace")
    except OSError:
        return None


def _scrape_stages(settings: Settings) -> dict[str, WorkerSample]:
    host = "127.0.0.1" if settings.metrics.bind in ("0.0.0.0", "") else settings.metrics.bind
    out: dict[str, WorkerSample] = {}
    for w in Supervisor(settings).workers():
        ws = out.setdefault(w.stage, WorkerSample(w.stage, 0, 0))
        ws.workers += 1
        if not w.alive:
            continue
        ws.alive += 1
        port = w.metrics_port
        text = _scrape(host, port) if port else None
        if text is None:
            continue
        ws.scraped = True
        for name, buckets in parse_histograms(text).items():
            acc = ws.histograms.setdefault(name, {})
            for b, c in buckets.items():
                acc[b] = acc.get(b, 0.0) + c
    return out


async def sample(settings: Settings, reader: LagReader) -> Sample:
    """Scrape every worker and read the lag once. Lag is [] when the broker cannot answer."""
    from aiokafka.errors import KafkaError

    stages = await asyncio.to_thread(_scrape_stages, settings)
    try:
        await reader.start()
        lag = await reader.measure(settings.kafka.topic_prefix)
    except (KafkaError, OSError, asyncio.TimeoutError):
        await reader.close()
        lag = []
    return Sample(time.monotonic(), stages, lag)


async def run_top(settings: Settings, once: bool = False, interval_s: float = 1.0, console: Any = None,
                  as_json: bool = False) -> int:
    """Show the live view until Ctrl-C; with ``once``, print one frame (two samples
    ``interval_s`` apart, so rates exist) and return. Returns the exit status: 0, or 1
    when no worker of this topic prefix is known (nothing to show).

    On a terminal the frame redraws in place; piped, each frame is printed after the last
    (as ``top -b``); ``as_json`` prints one JSON document per line and frame."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    prefix = settings.kafka.topic_prefix
    async with LagReader(settings.kafka.bootstrap, client_kwargs(settings)) as reader:
        before = await sample(settings, reader)
        if not before.stages:
            print(f"mmstream: no workers for topic prefix {prefix!r} (mmstream up?)", file=sys.stderr)
            return 1
        await asyncio.sleep(interval_s)
        now = await sample(settings, reader)

        def show() -> None:
            if as_json:
                print(frame_json(now, before, prefix, time.time()), flush=True)
            else:
                console.print(render(now, before, prefix))

        if once or as_json or not console.is_terminal:
            while True:
                show()
                if once:
                    return 0
                await asyncio.sleep(interval_s)
                before, now = now, await sample(settings, reader)
        with Live(render(now, before, prefix), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(interval_s)
                before, now = now, await sample(settings, reader)
                live.update(render(now, before, prefix))


def cli_main(args: Any, settings: Settings) -> int:
    """``mmstream top [--once] [--json] [--interval S]``."""
    if args.interval <= 0:
        print(f"mmstream: --interval must be more than 0 seconds, not {args.interval}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_top(settings, once=args.once, interval_s=args.interval,
                                   as_json=getattr(args, "json", False)))
    except KeyboardInterrupt:
        return 0
