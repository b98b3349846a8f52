"""The local scaler: the ``autoscale`` worker that `mmstream up --autoscale` starts.

Every ``autoscale.interval_s`` it reads each pool's consumer lag on its shared topics from the
broker (``streams.observe.lagmon``; the same group and topics KEDA's triggers name; a tenant's own
ingress topics are not counted) and the queued work its replicas report through Redis
(``streams.stores.load_reports``), counts the live replicas from the supervisor's pid files, asks the pure
``streams.policies.autoscale.ScalePolicy`` what to change and has the ``Supervisor`` start or
stop replicas. Each decision, applied or held, is a line of JSON in
``<state_dir>/workers/<prefix>/autoscale.jsonl`` (`mmstream scale` prints them), a log line
and a count in ``mmstream_autoscale_decisions_total``.

A Redis read that fails leaves the queued work out of the tick (lag alone still scales); a
broker read that fails skips the tick (without lag, a pool whose records wait looks idle): the
scaler never scales on a number it could not read. A
pool being changed (a replica draining its batch after SIGTERM) gets no new decision until
the change is done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge
from redis.exceptions import RedisError

from mmstream.k8s_scalers import pool_topics
from mmstream.supervisor import AUTOSCALER, SPARE, Supervisor, proc_cpu_s
from schemas.settings import Settings
from streams.stores import load_reports
from streams.app import group_id
from streams.observe.health import WorkerHealth
from streams.observe.lagmon import LagReader, LagRow
from streams.observe.http import serve
from streams.policies.autoscale import CpuReading, Decision, PoolRule, PoolSignal, ScalePolicy
from streams.connection import client_kwargs
from schemas.topics import TopicNames
from workers.redisconn import connect_async

log = logging.getLogger(__name__)

LOAD_STALE_MS = 3_000.0
"""A load report older than this is a replica gone: its queued work is not counted."""


class BoxCpu:
    """The box's idle cores between two reads of ``/proc/stat`` (Linux), out of ``cores``, and
    the cores each pool's processes used meanwhile: what the policy's cores rule measures
    instead of guessing from the pools' threads. Idle counts every process of the box, the
    broker, Redis and whatever else runs there, not only ours."""

    def __init__(self, cores: int, path: str = "/proc/stat") -> None:
        self.cores, self.path = cores, path
        self._last: tuple[float, float] | None = None
        self._procs: dict[int, tuple[float, float]] = {}
        """pid -> (when, its CPU seconds then), from the last read."""

    def reading(self, procs: Iterable[tuple[str, int]]) -> CpuReading | None:
        """What the box and each pool (``(stage, pid)`` of its live replicas) did since the
        last call; None where the box's CPU cannot be read."""
        idle = self.idle_cores()
        now, used, seen = time.monotonic(), Counter[str](), {}
        for stage, pid in procs:
            cpu = proc_cpu_s(pid)
            if cpu is None:
                continue
            seen[pid] = (now, cpu)
            last = self._procs.get(pid)
            if last is not None and now > last[0]:
                used[stage] += (cpu - last[1]) / (now - last[0])
        self._procs = seen
        return None if idle is None else CpuReading(idle, dict(used))

    def idle_cores(self) -> float | None:
        """Idle cores since the last call; None on the first call or where it cannot be read."""
        try:
            with open(self.path) as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        if len(fields) < 5:
            return None
        total, idle = sum(fields[:8]), fields[3] + fields[4]  # idle + iowait
        last, self._last = self._last, (total, idle)
        if last is None or total <= last[0]:
            return None
        busy = (1.0 - (idle - last[1]) / (total - last[0])) * (os.cpu_count() or 1)
        return max(0.0, self.cores - busy)


def cores(settings: Settings) -> int:
    return settings.autoscale.cpu_cores or os.cpu_count() or 1


def rules(settings: Settings) -> dict[str, PoolRule]:
    """The policy's rule per scaled pool: the settings' bounds and thresholds, and the cores one
    busy replica keeps busy (its engine's threads; 0 there means one per core)."""
    a, n = settings.autoscale, cores(settings)
    out = {}
    for stage, (low, high) in a.limits().items():
        if stage.startswith("encode."):
            threads = settings.encoder.intra_op_threads or n
        elif stage == "generate":
            threads = settings.generator.threads or n
        else:
            threads = 1
        out[stage] = PoolRule(low, high, {lane: a.lag_per_replica(stage, lane) for lane in ("rt", "bulk")},
                              a.target_queued_ms, threads)
    return out


def lane_of(topic: str) -> str | None:
    parts = topic.split(".")
    return "rt" if "rt" in parts else "bulk" if "bulk" in parts else None


def signals(prefix: str, pools: Iterable[str], live: Mapping[str, int], rows: Iterable[LagRow] | None,
            loads: Mapping[str, Mapping[str, Any]] | None, now_ms: float) -> list[PoolSignal]:
    """One signal per pool from what could be read (``None``: that source failed). Pure."""
    by_group = {group_id(prefix, stage): stage for stage in pools}
    lag: dict[str, Counter[str]] = {stage: Counter() for stage in pools}
    queued: Counter[str] = Counter()
    running: dict[str, list[float]] = {stage: [] for stage in pools}
    items: dict[str, int | None] = {stage: 0 for stage in pools}
    for row in rows or ():
        stage, lane = by_group.get(row.group), lane_of(row.topic)
        if stage is not None and lane is not None:
            lag[stage][lane] += row.lag
    for report in (loads or {}).values():
        try:
            stage, at, ms = str(report["stage"]), float(report["at"]), float(report["queued_ms"])
            in_service = min(ms, float(report.get("running_ms", 0.0)))
            held = None if report.get("items") is None else int(report["items"])
        except (KeyError, TypeError, ValueError):
            continue
        if stage in lag and now_ms - at <= LOAD_STALE_MS:
            queued[stage] += ms
            running[stage].append(in_service)
            before = items[stage]
            items[stage] = None if before is None or held is None else before + held
    return [PoolSignal(stage, live.get(stage, 0), dict(lag[stage]), queued[stage], tuple(running[stage]),
                       items[stage] if running[stage] else None)
            for stage in pools]


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.replicas = Gauge("mmstream_autoscale_replicas", "Live replicas of each scaled pool.", ("stage",),
                              registry=self.registry)
        self.demand = Gauge("mmstream_autoscale_demand_replicas", "Replicas the pool's lag and queued work ask for.",
                            ("stage",), registry=self.registry)
        self.decisions = PromCounter("mmstream_autoscale_decisions_total",
                                     "Scaling decisions per pool, by reason; held=true: wanted and refused.",
                                     ("stage", "reason", "held"), registry=self.registry)


class LocalScaler:
    def __init__(self, settings: Settings, supervisor: Supervisor | None = None) -> None:
        self.settings = settings
        self.supervisor = supervisor or Supervisor(settings, spares=settings.autoscale.spare)
        a = settings.autoscale
        self.rules = rules(settings)
        self.policy = ScalePolicy(self.rules, up_window_s=a.up_window_s, down_window_s=a.down_window_s,
                                  idle_s=a.idle_s, cpu_cores=cores(settings))
        self.cpu = BoxCpu(cores(settings))
        self.metrics = _Metrics()
        self.health = WorkerHealth()
        self.health.stage = AUTOSCALER
        self.last_tick = 0.0
        self.health.require(AUTOSCALER, ready=lambda: time.monotonic() - self.last_tick < 5 * a.interval_s + 5)
        self.log_file = self.supervisor.dir / "autoscale.jsonl"
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._spawning = asyncio.Lock()
        self._held: dict[str, tuple[int, str]] = {}
        self.reader = LagReader(settings.kafka.bootstrap, client_kwargs(settings))
        names, prefix = TopicNames(settings.kafka.topic_prefix), settings.kafka.topic_prefix
        self.watched = {group_id(prefix, stage): list(pool_topics(names, stage).values()) for stage in self.rules}
        """Group -> the shared topics whose lag scales its pool (``mmstream.k8s_scalers``: KEDA's too)."""
        self.redis = connect_async(settings.redis.url, settings.redis.tls_ca, socket_timeout=0.5,
                                   socket_connect_timeout=0.5)

    async def _lag(self) -> list[LagRow] | None:
        try:
            await self.reader.start()
            return await self.reader.measure_groups(self.watched)
        except (KafkaError, OSError, asyncio.TimeoutError) as exc:
            log.warning("autoscale: lag not read this tick: %r", exc)
            return None

    async def _loads(self) -> dict[str, dict[str, Any]] | None:
        try:
            return await load_reports.read_loads(self.redis, self.settings.kafka.topic_prefix)
        except (RedisError, OSError) as exc:
            log.warning("autoscale: load reports not read this tick: %r", exc)
            return None

    async def tick(self) -> list[Decision]:
        rows, loads = await asyncio.gather(self._lag(), self._loads())
        procs = [(w.stage, w.pid) for w in self.supervisor.workers() if w.alive]
        live = Counter(stage for stage, _ in procs)
        now = time.monotonic()
        sigs = signals(self.settings.kafka.topic_prefix, self.rules, live, rows, loads, time.time() * 1000)
        if rows is None:  # without lag a pool with records waiting looks idle: decide nothing this tick
            sigs = []
        for s in sigs:
            self.metrics.replicas.labels(s.stage).set(s.replicas)
        free = [s for s in sigs if s.stage not in self._busy]
        decisions = self.policy.decide(now, free, self.cpu.reading(procs))
        for d in decisions:
            self._record(d)
            if not d.held:
                self._busy[d.stage] = asyncio.create_task(self._apply(d))
        self.last_tick = now
        return decisions

    def _record(self, d: Decision) -> None:
        self.metrics.demand.labels(d.stage).set(d.demand)
        if d.held and self._held.get(d.stage) == (d.current, d.reason):
            return  # said already: one line per held state, not one per tick
        self._held.pop(d.stage, None)
        if d.held:
            self._held[d.stage] = (d.current, d.reason)
        self.metrics.decisions.labels(d.stage, d.reason, str(d.held).lower()).inc()
        line = {"at": round(time.time(), 3), "stage": d.stage, "from": d.current, "to": d.target, "reason": d.reason,
                "demand": d.demand, "held": d.held}
        log.info("autoscale: %s %d -> %d (%s%s, demand %d)", d.stage, d.current, d.target, d.reason,
                 ", held" if d.held else "", d.demand)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "a") as f:
            f.write(json.dumps(line) + "\n")

    async def _apply(self, d: Decision) -> None:
        try:
            if d.target > d.current:
                async with self._spawning:  # one at a time: each new worker takes the next free port
                    await asyncio.to_thread(self.supervisor.spawn_missing, d.stage, d.target)
            else:
                await asyncio.to_thread(self.supervisor.stop_beyond, d.stage, d.target)
            await asyncio.to_thread(self.supervisor.write_targets)
        except Exception:  # noqa: BLE001 - a failed change is logged; the next tick decides again
            log.exception("autoscale: %s -> %d failed", d.stage, d.target)
        finally:
            self.policy.changed(d.stage, time.monotonic())
            self._busy.pop(d.stage, None)

    async def run(self, stop: asyncio.Event) -> None:
        interval = self.settings.autoscale.interval_s
        if self.supervisor.spares:
            await asyncio.to_thread(self.supervisor.ensure_spare)
        try:
            while not stop.is_set():
                started = time.monotonic()
                await self.tick()
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, interval - (time.monotonic() - started)))
                except asyncio.TimeoutError:
                    pass
        finally:
            if self._busy:
                await asyncio.gather(*self._busy.values(), return_exceptions=True)
            if self.supervisor.spares:  # nobody turns it into a replica any more
                await asyncio.to_thread(self.supervisor.stop_beyond, SPARE, 0, 5.0)
            await self.reader.close()
            await self.redis.aclose()


def run_autoscaler(settings: Settings, replica: int = 0) -> None:
    """The ``autoscale`` worker's entry point: serve its metrics, scale until SIGTERM."""
    scaler = LocalScaler(settings)
    port = serve(settings.metrics.port, scaler.metrics.registry, settings.metrics.bind, scaler.health)
    port_file = Path(scaler.supervisor.dir) / f"{AUTOSCALER}-{replica}.port"
    port_file.parent.mkdir(parents=True, exist_ok=True)
    port_file.write_text(str(port))
    log.info("autoscale: metrics on :%d, pools %s", port, settings.autoscale.pools)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await scaler.run(stop)

    asyncio.run(main())
