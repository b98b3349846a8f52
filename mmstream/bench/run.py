"""Running a bench: the schedule sent open loop to the pipeline (over Kafka) or to the
monolithic baseline (in this process), and what each run cost in CPU and memory.

Open loop: requests are sent on a schedule fixed by the seed, whether or not earlier ones
have been answered, so a slow server shows up as queueing instead of a lower offered
rate. e2e is measured by the client (send -> terminal event received) in pipeline mode,
and from arrival in the queue to the batch's end in monolithic mode.

Process accounting reads /proc: CPU seconds and peak RSS of each local pipeline worker
(found through the supervisor), or of this process for the monolith.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from mmstream import localstack
from mmstream.bench.config import BenchConfig, config_dict
from mmstream.bench.paired import pair
from mmstream.bench.results import Record, build_run, overhead, shed_cause
from mmstream.bench.timeline import Sampler, settle, windows
from mmstream.bench.workloads import floor_text, request_kind, run_tenants, sample_images, schedule
from mmstream.levers import own_pipeline
from mmstream.levers import replicas as lever_replicas
from mmstream.monolith import Engines, ModelServer, Monolith
from mmstream.stats import summary
from mmstream.supervisor import AUTOSCALER, Supervisor, proc_cpu_s
from schemas.request import Lane, Request
from schemas.settings import Settings
from streams.sdk.client import Client, Submission, new_id
from streams.connection import KafkaSecurity
from streams.policies.batching import BatchLimits

log = logging.getLogger(__name__)

# -- process accounting --------------------------------------------------------------

class CpuTally:
    """CPU seconds per process name over a run, also of processes that start or stop during it
    (a scaler's replicas, a spare turned into one): each pid counts from its first read (from
    zero when it started after the run began) to its last read, under the name it had last."""

    def __init__(self, procs: Sequence[tuple[str, int]]) -> None:
        self.first = {pid: cpu for _, pid in procs if (cpu := proc_cpu_s(pid)) is not None}
        self.last: dict[int, tuple[str, float]] = {}
        self.read(procs)

    def read(self, procs: Sequence[tuple[str, int]]) -> None:
        for name, pid in procs:
            cpu = proc_cpu_s(pid)
            if cpu is not None:
                self.last[pid] = (name, cpu)

    def per_name(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (name, cpu) in self.last.items():
            out[name] = round(out.get(name, 0.0) + cpu - self.first.get(pid, 0.0), 3)
        return out


def proc_peak_rss_mb(pid: int) -> float | None:
    """Peak resident set (VmHWM) of ``pid`` since it started, in MiB; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError):
        pass
    return None


REPO_ROOT = Path(__file__).resolve().parents[2]


def _workers(settings: Settings) -> list[tuple[str, int]]:
    """Every process the pipeline runs on this machine, named: its workers, and the local
    broker and Redis when this machine runs them (their CPU per request counts too)."""
    return _named(Supervisor(settings).workers()) + _services(settings)


def _named(workers: Sequence[Any]) -> list[tuple[str, int]]:
    return [(f"{w.stage}[{w.replica}]", w.pid) for w in workers if w.alive]


def _services(settings: Settings) -> list[tuple[str, int]]:
    """The local broker and Redis, when this machine runs them."""
    try:
        kafka, redis = localstack.status(settings, REPO_ROOT)
    except Exception:  # external services, or none
        return []
    return [(name, st.pid) for name, st in (("broker", kafka), ("redis", redis)) if st.pid]


# -- running ---------------------------------------------------------------------------


async def run_bench(settings: Settings, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg``: per rate of ``cfg.sweep``, ``cfg.rounds`` runs (each followed by one of
    ``cfg.vs`` when set), each fed by ``schedule(cfg, rate)``.

    Loads the text engine (and the image engine for ``mixed``) in this process first to
    measure ``floor_ms``; monolithic mode then serves with them. Raises ``ValueError`` on a
    bad config, ``ClientError`` when the pipeline is not up (pipeline mode), and whatever
    loading a model raises.
    """
    mono = cfg.mode in ("monolithic", "server") or cfg.vs is not None
    images = cfg.workload in ("mixed", "capacity", "images", "chat-mm")
    engines = await asyncio.to_thread(Engines, settings, images,
                                      mono and cfg.workload == "mixed", mono and cfg.workload in ("chat", "chat-mm"))
    floor = engines.floor_ms(floor_text(), sample_images()[0] if images else None,
                             cfg.floor_repeats)
    runs = []
    modes = (cfg.mode,) if cfg.vs is None else (cfg.mode, cfg.vs)
    for rate in cfg.sweep:
        for number in range(1, cfg.rounds + 1):
            for mode in modes:
                run = await _one_run(settings, dataclasses.replace(cfg, mode=mode, vs=None), rate, engines, progress)
                run["floor_ms"] = floor
                run["engines"] = engines.info
                run["overhead_ms"] = overhead(run["latency_ms"], floor)
                if len(modes) > 1 or cfg.rounds > 1:
                    run["round"] = number
                runs.append(run)
    if len(runs) == 1:
        return runs[0]
    doc = {"mode": cfg.mode, "workload": cfg.workload, "seed": cfg.seed, "config": config_dict(cfg), "runs": runs}
    if cfg.vs is not None:
        doc["paired"] = pair(runs, cfg.mode, cfg.vs)
    return doc


async def _one_run(settings: Settings, cfg: BenchConfig, rate: float, engines: Engines,
                   progress: bool) -> dict[str, Any]:
    """One run of ``cfg.mode`` at ``rate``."""
    if cfg.mode == "pipeline" and (cfg.levers_off or cfg.own_pipeline or cfg.scheduler or cfg.lm_precision
                                   or cfg.autoscale):
        extra = {"MMSTREAM_GENERATOR_SCHEDULER": cfg.scheduler} if cfg.scheduler else {}
        if cfg.lm_precision:
            extra["MMSTREAM_GENERATOR_PRECISION"] = cfg.lm_precision
        if cfg.autoscale:  # the scaler keeps to the pools this run deploys (else their minimum starts them)
            deployed = lever_replicas(cfg.levers_off, cfg.workload)
            extra["MMSTREAM_AUTOSCALE_POOLS"] = ",".join(
                f"{stage}={low}:{high}" for stage, (low, high) in settings.autoscale.limits().items()
                if stage in deployed)
        async with own_pipeline(settings, cfg.levers_off, cfg.workload, extra_env=extra,
                                extra_replicas={AUTOSCALER: 1} if cfg.autoscale else None) as run_settings:
            run = await _run_pipeline(run_settings, cfg, rate, progress)
        run["autoscale"] = cfg.autoscale
        run["levers_off"] = list(cfg.levers_off)
        if cfg.scheduler:
            run["scheduler"] = cfg.scheduler
        if cfg.lm_precision:
            run["lm_precision"] = cfg.lm_precision
    elif cfg.mode == "pipeline":
        run = await _run_pipeline(settings, cfg, rate, progress)
    else:
        run = await _run_monolith(settings, cfg, rate, engines, progress)
    return run


async def _send_on_schedule(offsets: Sequence[float], requests: Sequence[Request],
                            send: Callable[..., Any], progress: bool) -> float:
    """Call ``send(request, scheduled_at_ms)`` for each request at its offset (``scheduled_at_ms``:
    the wall-clock time it was due, from which its latency counts, so a client that falls
    behind its schedule cannot hide queueing); returns the seconds the sending took."""
    bar = _Progress(len(offsets), enabled=progress)
    start = time.monotonic()
    wall0 = time.time() * 1000.0
    try:
        for offset, req in zip(offsets, requests):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            result = send(req, wall0 + offset * 1000.0)
            if asyncio.iscoroutine(result):
                await result
            bar.advance()
    finally:
        bar.close()
    return time.monotonic() - start


async def _run_pipeline(settings: Settings, cfg: BenchConfig, rate: float, progress: bool) -> dict[str, Any]:
    offsets, requests = schedule(cfg, rate)
    tenant = cfg.tenant or f"bench-{new_id()[:12]}"
    requests = run_tenants(requests, tenant, salt=new_id()[:8])
    workers = _workers(settings)
    if not workers:
        log.warning("no local workers for topic prefix %r: CPU and RSS will be empty (pipeline elsewhere?)",
                    settings.kafka.topic_prefix)
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix,
                      security=KafkaSecurity.from_settings(settings.kafka)) as client:
        tally = CpuTally(workers)
        own0 = time.process_time()
        one_lane = "lanes" in cfg.levers_off
        services = _services(settings)
        sampler = (Sampler(Supervisor(settings), lambda live: tally.read(_named(live) + services))
                   if cfg.rate_schedule else None)
        if sampler is not None:
            sampler.start()
        start_ms = time.time() * 1000.0
        pairs, sent_s = await send_and_drain(client, offsets, requests, cfg, progress,
                                             lambda r: dataclasses.replace(r, lane=Lane.RT) if one_lane else r)
        replicas_over_time = await sampler.stop() if sampler is not None else []
        workers = _workers(settings)  # a scaler may have started some: count every one still alive
        tally.read(workers)
        own_cpu_s = time.process_time() - own0
    records = [_pipeline_record(req, sub) for req, sub in pairs]
    worker_cpu = tally.per_name()
    ok = sum(r.outcome == "ok" for r in records)
    cpu = {
        "scope": "sum of the pipeline's processes on this machine: workers, and the broker and Redis when local "
                 "(the client apart)",
        "total_s": round(sum(worker_cpu.values()), 3),
        "per_process_s": worker_cpu,
        "client_s": round(own_cpu_s, 3),
    }
    cpu["per_request_ms"] = round(cpu["total_s"] * 1000.0 / ok, 3) if ok else None
    rss = {name: proc_peak_rss_mb(pid) for name, pid in workers}
    run = build_run("pipeline", cfg, rate, records, sent_s, cpu, rss)
    if cfg.rate_schedule:
        wins = windows(records, start_ms)
        steps = [sum(d for _, d in cfg.rate_schedule[:i]) for i in range(len(cfg.rate_schedule))]
        run["timeline"] = {"schedule": [list(seg) for seg in cfg.rate_schedule], "windows": wins,
                           "replicas": replicas_over_time, "text_p99_settled_s": settle(wins, steps)}
    cache = [sub.terminal.cache or {} for _, sub in pairs if sub.terminal is not None]
    hits, misses = sum(int(c.get("hits", 0)) for c in cache), sum(int(c.get("misses", 0)) for c in cache)
    run["cache"] = {"tenant": tenant, "hits": hits, "misses": misses,
                    "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}
    return run


async def send_and_drain(client: Client, offsets: Sequence[float], requests: Sequence[Request], cfg: BenchConfig,
                         progress: bool, adjust: Callable[[Request], Request] = lambda r: r,
                         ) -> tuple[list[tuple[Request, Submission]], float]:
    """Send ``requests`` open loop at ``offsets`` (each as ``adjust`` makes it; latency counts
    from its scheduled arrival), then wait up to ``cfg.drain_s`` for their answers. Returns
    (request, submission) pairs in send order and the seconds the sending took."""
    pairs: list[tuple[Request, Submission]] = []
    waits: list[asyncio.Task] = []

    async def send(req: Request, due_ms: float) -> None:
        sub = await client.submit(adjust(req))
        sub.sent_at_ms = due_ms
        pairs.append((req, sub))
        waits.append(asyncio.create_task(_wait(sub, cfg.duration_s + cfg.drain_s)))

    sent_s = await _send_on_schedule(offsets, requests, send, progress)
    if waits:
        await asyncio.wait(waits, timeout=cfg.drain_s)
    for t in waits:
        t.cancel()
    return pairs, sent_s


async def _wait(sub: Submission, timeout_s: float) -> None:
    try:
        await sub.result(timeout_s)
    except asyncio.TimeoutError:
        pass


def _pipeline_record(req: Request, sub: Submission) -> Record:
    rec = Record(request_kind(req), tuple(str(p.modality) for p in req.parts), sub.sent_at_ms, lane=str(req.lane),
                 submitted_at_ms=sub.submitted_at_ms)
    t = sub.terminal
    if t is None:
        return rec
    rec.done_at_ms = sub.terminal_at_ms
    rec.answered_at_ms = t.ts_ms
    if t.kind == "result":
        rec.outcome = "ok"
    else:
        rec.outcome = (t.error or {}).get("code", "internal")
        rec.retry_after_ms = (t.error or {}).get("retry_after_ms")
        rec.cause = shed_cause(rec.outcome, str((t.error or {}).get("message") or ""))
    rec.stages = [dict(s) for s in (t.timings or {}).get("stages", [])]
    rec.ttft_ms = (t.timings or {}).get("ttft_ms")
    rec.tpot_ms = (t.timings or {}).get("tpot_ms")
    rec.completion_tokens = int(((t.payload or {}).get("tokens") or {}).get("completion", 0) or 0)
    c = t.cache or {}
    if c.get("hits") or c.get("misses"):
        rec.cache = "miss" if c.get("misses") else "hit"
    return rec


async def _run_monolith(settings: Settings, cfg: BenchConfig, rate: float, engines: Any,
                        progress: bool) -> dict[str, Any]:
    offsets, requests = schedule(cfg, rate)
    limits = BatchLimits(cfg.max_batch_size or settings.encoder.max_batch_size,
                         (cfg.max_wait_ms if cfg.max_wait_ms is not None else settings.encoder.max_wait_ms) / 1000.0)
    mono = ModelServer(engines, limits) if cfg.mode == "server" else Monolith(engines, limits)
    cpu0 = time.process_time()
    server = asyncio.create_task(mono.run())
    sent_s = await _send_on_schedule(offsets, requests, mono.submit, progress)
    mono.close()
    try:
        await asyncio.wait_for(asyncio.shield(server), cfg.drain_s)
    except asyncio.TimeoutError:
        pass  # what is still queued counts as lost; the thread finishes its batch and stops
    cpu_s = time.process_time() - cpu0
    records = []
    for o in mono.outcomes:
        rec = Record(request_kind(o.request), tuple(str(p.modality) for p in o.request.parts), o.arrived_at_ms,
                     lane=str(o.request.lane), ttft_ms=o.ttft_ms, tpot_ms=o.tpot_ms)
        if o.finished_at_ms is not None:
            rec.done_at_ms = o.finished_at_ms
            rec.outcome = "ok" if len(o.errors) < len(o.request.parts) else "internal"
            rec.stages = list(o.spans)
        records.append(rec)
    ok = sum(r.outcome == "ok" for r in records)
    cpu = {"scope": f"the bench process ({cfg.mode} baseline and its arrival loop)", "total_s": round(cpu_s, 3),
           "per_process_s": {cfg.mode: round(cpu_s, 3)},
           "per_request_ms": round(cpu_s * 1000.0 / ok, 3) if ok else None}
    rss = {cfg.mode: round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}
    run = build_run(cfg.mode, cfg, rate, records, sent_s, cpu, rss)
    run["batch_size"] = summary(mono.batch_sizes)
    run["batching"] = {"max_batch_size": limits.max_batch_size, "max_wait_ms": limits.max_wait_s * 1000.0}
    if not server.done():
        server.cancel()
    return run


class _Progress:
    """A progress bar of the sending on stderr (stdout carries the JSON), or nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress

            self._p = Progress(console=Console(stderr=True), transient=True)
            self._p.start()
            self._task = self._p.add_task("sending", total=total)

    def advance(self) -> None:
        if self._p:
            self._p.advance(self._task)

    def close(self) -> None:
        if self._p:
            self._p.stop()
