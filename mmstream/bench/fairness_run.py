"""Running the fairness workload against the running pipeline (``mmstream bench --workload
fairness``): B alone, then B while A floods, each phase ``duration_s`` of arrivals and up to
``drain_s`` for the answers, the processes' memory and the encoders' load reports sampled
every ``SAMPLE_S`` throughout.

A sends from a process of its own (its own client, producer and event loop), so the
megabytes it produces and the answers it reads do not delay the loop that timestamps B's
answers; the two still share the machine's cores with the pipeline, as tenants would share
a node. A sends open loop on its plan; at most ``ABUSER_SENDS_IN_FLIGHT`` produce calls wait
on the broker at once, so where the broker cannot take A's bytes A falls behind its plan
(its ``offered_rate`` says by how much) instead of piling up sends in memory.

The ``ref_fanout`` blob is stored once in Redis under A's claim prefix before the run.

Against a secured broker (settings that authenticate, as `mmstream up --secure`'s
``mmstream.env`` gives) the two tenants are made for the run with ``add_tenant``, as
`mmstream tenant add` makes them (credentials, their own ingress topics, ACLs, the broker's
produce quota), and each sends as itself: the tenant is the principal's, not a field, and
A's bytes meet the broker's quota before any stage reads them. Otherwise they are two
names on the shared plaintext ingress.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import time
from typing import Any

from mmstream.bench.config import BenchConfig, config_dict
from mmstream.bench.abuse import (AbuseBounds, abuse_request, abuse_shapes, abuser_plan, pixel_bound_png, ref_blob,
                                  victim_schedule)
from mmstream.bench.fairness import (abuser_summary, load_summary, memory_summary, stage_bounds, victim_comparison,
                                     verdict)
from mmstream.bench.results import build_run, overhead
from mmstream.bench.workloads import floor_text
from mmstream.bench.run import _pipeline_record, _workers, proc_cpu_s, send_and_drain
from mmstream.monolith import Engines
from mmstream.tenants import add_tenant
from schemas.request import Modality, Part, Request, claim_prefix
from schemas.settings import Settings
from streams.stores import load_reports
from streams.sdk.client import Client, new_id
from streams.connection import KafkaSecurity
from workers.redisconn import connect_async

log = logging.getLogger(__name__)

SAMPLE_S = 0.5
ABUSER_SENDS_IN_FLIGHT = 64
ABUSER_START_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 60.0


async def run_fairness(settings: Settings, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Both phases of ``cfg`` (workload ``fairness``) against the pipeline ``settings`` name;
    returns the run's JSON (``victim``, ``abuser``, ``memory``, ``load``, ``verdict``; B's two
    phases in full, as ``build_run`` reports them, under ``phases``). Raises ``ClientError``
    when the pipeline is not up, and ``RuntimeError`` when A's process does not start."""
    rate = cfg.rate
    abuse_rate = cfg.abuse_rate or 5.0 * rate
    salt = new_id()[:8]
    victim, abuser = f"victim-{salt}", f"abuser-{salt}"
    secured = settings.kafka.authenticated and settings.kafka.security_protocol.startswith("SASL_")
    if secured:
        ids = {name: _Identity(name, (await add_tenant(settings, name)).security) for name in (victim, abuser)}
        # A new tenant's ingress topics reach the router at its next topic scan: wait for
        # one answer each, so that B's first phase does not measure the discovery.
        await asyncio.gather(*(ident.probe(settings) for ident in ids.values()))
    else:
        shared = KafkaSecurity.from_settings(settings.kafka)
        ids = {name: _Identity(None, shared) for name in (victim, abuser)}
    workers = _workers(settings)
    if not workers:
        log.warning("no local workers for topic prefix %r: memory and CPU will be empty", settings.kafka.topic_prefix)
    running = {name.split("[")[0] for name, _ in workers}
    shapes = abuse_shapes(cfg.abuse_shapes, "generate" in running, "encode.audio" in running)
    bounds = AbuseBounds.from_settings(settings)
    deadline_ms = min(cfg.abuse_deadline_ms or bounds.max_deadline_ms, bounds.max_deadline_ms)
    # B's compute floor, as every bench run states it; the engine is let go before the phases.
    engines = await asyncio.to_thread(Engines, settings, False)
    floor, engine_info = engines.floor_ms(floor_text(), None, cfg.floor_repeats), engines.info
    del engines
    redis = connect_async(settings.redis.clients, settings.redis.tls_ca or None)
    blob_key = f"{claim_prefix(abuser)}blob"
    try:
        await redis.set(blob_key, ref_blob(bounds), ex=settings.limits.claim_ttl_s)
        sampler = _Sampler(workers, redis, settings.kafka.topic_prefix)
        sampling = asyncio.create_task(sampler.run())
        phases: dict[str, dict[str, Any]] = {}
        try:
            sampler.phase = "alone"
            phases["alone"] = await _victim_phase(settings, cfg, victim, ids[victim], "alone", workers, progress)
            sampler.phase = "flood"
            a = _Abuser(settings, cfg.seed, abuse_rate, cfg.duration_s, cfg.drain_s, shapes, abuser, ids[abuser],
                        f"redis:{blob_key}", deadline_ms)
            await a.start()
            try:
                phases["flood"] = await _victim_phase(settings, cfg, victim, ids[victim], "flood", workers, progress)
                a_records = await a.records(cfg.duration_s + 2 * cfg.drain_s + 30.0)
            finally:
                a.stop()
        finally:
            sampler.stop()
            await sampling
    finally:
        try:
            await redis.delete(blob_key)
        finally:
            await redis.aclose()
    for run in phases.values():
        run["floor_ms"], run["engines"] = floor, engine_info
        run["overhead_ms"] = overhead(run["latency_ms"], floor)
    v = victim_comparison(phases["alone"], phases["flood"])
    ab = abuser_summary(a_records, cfg.duration_s, horizon_s=cfg.duration_s + cfg.drain_s,
                        deadline_s=deadline_ms / 1000.0)
    mem = memory_summary(sampler.rss, stage_bounds(settings))
    doc = {
        "mode": "pipeline", "workload": "fairness", "ingress": "tenant principals" if secured else "shared plaintext",
        "config": {**config_dict(cfg), "abuse_rate": abuse_rate, "abuse_deadline_ms": deadline_ms},
        "tenants": {"victim": victim, "abuser": abuser}, "abuse_shapes": list(shapes),
        "bounds": dataclasses.asdict(bounds), "victim": v, "abuser": ab, "memory": mem,
        "load": load_summary(sampler.loads), "phases": phases,
    }
    doc["verdict"] = verdict(v, ab, mem)
    return doc


@dataclasses.dataclass(frozen=True)
class _Identity:
    """How one tenant's client connects: as its own principal (``tenant`` set: its ingress
    topics and reply topic) or on the shared topics (``tenant`` None)."""

    tenant: str | None
    security: KafkaSecurity

    def client(self, settings: Settings) -> Client:
        return Client(settings.kafka.bootstrap, settings.kafka.topic_prefix, security=self.security,
                      tenant=self.tenant)

    async def probe(self, settings: Settings) -> None:
        """Send one short rt text embed and wait for its answer (``PROBE_TIMEOUT_S``)."""
        async with self.client(settings) as client:
            request = Request(id=f"probe-{new_id()}", tenant=self.tenant or "default",
                              parts=(Part(Modality.TEXT, text="a probe"),))
            event = await (await client.submit(request)).result(PROBE_TIMEOUT_S)
        if event.kind != "result":
            raise RuntimeError(f"tenant {self.tenant}'s probe request was answered {event.error}")


async def _victim_phase(settings: Settings, cfg: BenchConfig, tenant: str, ident: _Identity, phase: str,
                        workers: list[tuple[str, int]], progress: bool) -> dict[str, Any]:
    """B's traffic of ``phase``, sent open loop; its ``build_run`` report, with the CPU
    each pipeline process spent over the phase."""
    offsets, requests = victim_schedule(cfg.seed, cfg.rate, cfg.duration_s, phase, cfg.victim_images)
    requests = [dataclasses.replace(r, tenant=tenant) for r in requests]
    cpu0 = {name: proc_cpu_s(pid) for name, pid in workers}
    async with ident.client(settings) as client:
        pairs, sent_s = await send_and_drain(client, offsets, requests, cfg, progress)
    cpu1 = {name: proc_cpu_s(pid) for name, pid in workers}
    per = {n: round(cpu1[n] - cpu0[n], 3) for n in cpu0 if cpu0[n] is not None and cpu1.get(n) is not None}
    cpu = {"scope": "each pipeline process over the phase, whoever's work it was", "total_s": round(sum(per.values()), 3),
           "per_process_s": per, "per_request_ms": None}
    run = build_run("pipeline", cfg, cfg.rate, [_pipeline_record(q, s) for q, s in pairs], sent_s, cpu, {})
    run["phase"] = phase
    return run


class _Sampler:
    """Every ``SAMPLE_S``: each process's RSS and each encoder replica's load report, with
    the phase they were taken in."""

    def __init__(self, workers: list[tuple[str, int]], redis: Any, prefix: str) -> None:
        self.workers, self.redis, self.prefix = workers, redis, prefix
        self.phase = "alone"
        self.rss: list[tuple[float, str, dict[str, float]]] = []
        self.loads: list[tuple[float, str, dict[str, dict[str, float]]]] = []
        self._stop = asyncio.Event()
        self._t0 = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self._t0
            rss = {name: mb for name, pid in self.workers if (mb := proc_rss_mb(pid)) is not None}
            self.rss.append((t, self.phase, rss))
            reports = await load_reports.read_loads(self.redis, self.prefix)
            self.loads.append((t, self.phase, {name: {"queued_ms": float(r.get("queued_ms", 0.0)),
                                                      "queued_rt_ms": float(r.get("queued_rt_ms", 0.0))}
                                               for name, r in reports.items() if isinstance(r, dict)}))
            try:
                await asyncio.wait_for(self._stop.wait(), SAMPLE_S)
            except asyncio.TimeoutError:
                pass


def proc_rss_mb(pid: int) -> float | None:
    """Resident set (VmRSS) of ``pid`` now, in MiB; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError):
        pass
    return None


# -- the abuser's process -------------------------------------------------------------


class _Abuser:
    """A's sender in a process of its own: ``start`` returns once it is connected and its
    media are built, and tells it to go; ``records`` waits for its outcomes."""

    def __init__(self, settings: Settings, seed: int, abuse_rate: float, duration_s: float, drain_s: float,
                 shapes: tuple[str, ...], tenant: str, ident: _Identity, blob_ref: str, deadline_ms: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_abuser_main, name="mmstream-bench-abuser", daemon=True,
                                 args=(child, settings, seed, abuse_rate, duration_s, drain_s, shapes, tenant, ident,
                                       blob_ref, deadline_ms))

    async def start(self) -> None:
        self._proc.start()
        if not await asyncio.to_thread(self._conn.poll, ABUSER_START_TIMEOUT_S):
            raise RuntimeError(f"the abuser's process was not ready within {ABUSER_START_TIMEOUT_S:.0f} s")
        msg = self._conn.recv()
        if msg != "ready":
            raise RuntimeError(f"the abuser's process failed to start: {msg}")
        self._conn.send("go")

    async def records(self, timeout_s: float) -> list[dict[str, Any]]:
        if not await asyncio.to_thread(self._conn.poll, timeout_s):
            raise RuntimeError(f"the abuser's process sent no outcomes within {timeout_s:.0f} s")
        got = self._conn.recv()
        if isinstance(got, str):
            raise RuntimeError(f"the abuser's process failed: {got}")
        return got

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)


def _abuser_main(conn: Any, settings: Settings, seed: int, abuse_rate: float, duration_s: float, drain_s: float,
                 shapes: tuple[str, ...], tenant: str, ident: _Identity, blob_ref: str, deadline_ms: int) -> None:
    """The abuser process: its plan sent, one outcome dict per request sent back on ``conn``
    (or one string saying what failed)."""
    logging.basicConfig(level=logging.WARNING)
    # Another tenant's program: a session of its own, as a program started apart from B's
    # would have. In B's session the scheduler would give both clients one share of the CPU
    # together (Linux autogroups), and A's own TLS work would delay B's client, not the pipeline.
    os.setsid()
    try:
        bounds = AbuseBounds.from_settings(settings)
        plan = abuser_plan(seed, abuse_rate, duration_s, shapes)
        pixel_bound_png(bounds.image_side)  # built before the clock starts
        records = asyncio.run(_abuse(conn, settings, plan, bounds, tenant, ident, blob_ref, deadline_ms,
                                     duration_s + drain_s))
    except BaseException as exc:  # noqa: BLE001 - told to the parent, which fails the run
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(records)


async def _abuse(conn: Any, settings: Settings, plan: list[Any], bounds: AbuseBounds, tenant: str, ident: _Identity,
                 blob_ref: str, deadline_ms: int, horizon_s: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    sends = asyncio.Semaphore(ABUSER_SENDS_IN_FLIGHT)
    async with ident.client(settings) as client:
        conn.send("ready")
        await asyncio.to_thread(conn.recv)  # "go"
        start = time.monotonic()

        async def one(item: Any) -> None:
            rec: dict[str, Any] = {"shape": item.shape, "lane": item.lane, "outcome": None, "message": "",
                                   "retry_after_ms": None, "due_s": round(item.offset_s, 3)}
            out.append(rec)
            try:
                async with sends:
                    sub = await client.submit(abuse_request(item, tenant, bounds, blob_ref, deadline_ms))
                rec["sent_s"] = round(time.monotonic() - start, 3)
                event = await sub.result(max(1.0, start + horizon_s - time.monotonic()))
            except asyncio.TimeoutError:
                return
            except Exception as exc:  # noqa: BLE001 - a send the client refused: say so, go on
                rec["outcome"], rec["message"] = "client_error", str(exc)[:300]
                return
            rec["done_s"] = round(time.monotonic() - start, 3)
            if event.kind == "result":
                rec["outcome"] = "ok"
            else:
                err = event.error or {}
                rec["outcome"] = err.get("code", "internal")
                rec["message"] = str(err.get("message", ""))[:300]
                rec["retry_after_ms"] = err.get("retry_after_ms")

        tasks = []
        for item in plan:
            delay = start + item.offset_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        if tasks:
            await asyncio.wait(tasks, timeout=max(1.0, start + horizon_s - time.monotonic()))
        for t in tasks:
            t.cancel()
    return out
