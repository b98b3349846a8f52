"""Carrying out a scenario's faults (see ``scenario.py`` for the actions) on its own pipeline
and its own infrastructure. Each fault is one coroutine that returns when the fault is over
(a killed replica started again, a stalled one continued, a toxic removed), so the runner
knows when each fault window ends."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from mmstream.chaos.infra import OwnKafka, OwnRedis, Toxiproxy
from mmstream.chaos.scenario import Fault
from mmstream.supervisor import Supervisor, WorkerProc

log = logging.getLogger(__name__)


@dataclass
class Targets:
    """What a fault can reach."""

    supervisor: Supervisor
    kafka: OwnKafka | None = None
    redis: OwnRedis | None = None
    proxy: Toxiproxy | None = None
    reader: Any = None
    """The runner's client: ``slow_reader`` pauses its reply consumer."""
    leader_topic: str | None = None
    security: dict[str, Any] = field(default_factory=dict)
    """The clients' options (``streams.connection.client_kwargs``) for the admin calls here."""


async def apply(fault: Fault, t: Targets) -> str:
    """Carry out ``fault``; returns a line saying what was done."""
    p = fault.params
    a = fault.action
    if a in ("kill", "term"):
        w = _victim(t.supervisor, p["stage"], int(p.get("replica", 0)))
        await asyncio.to_thread(t.supervisor.stop_one, w, 30.0, signal.SIGKILL if a == "kill" else signal.SIGTERM)
        await asyncio.sleep(float(p.get("restart_after_s", 0)))
        await asyncio.to_thread(_restart, t.supervisor, w)
        return f"{a} {w.stage}[{w.replica}] pid {w.pid}, started again"
    if a == "stall":
        w = _victim(t.supervisor, p["stage"], int(p.get("replica", 0)))
        os.kill(w.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(float(p["for_s"]))
        finally:
            os.kill(w.pid, signal.SIGCONT)
        return f"stopped {w.stage}[{w.replica}] for {p['for_s']} s, then continued"
    if a == "cpu_starve":
        w = _victim(t.supervisor, p["stage"], int(p.get("replica", 0)))
        period, stopped = float(p.get("period_ms", 1000)) / 1000, float(p.get("stopped_ms", 800)) / 1000
        end = time.monotonic() + float(p["for_s"])
        while time.monotonic() < end:
            os.kill(w.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(stopped)
            finally:
                os.kill(w.pid, signal.SIGCONT)
            await asyncio.sleep(max(0.0, period - stopped))
        return f"starved {w.stage}[{w.replica}]: stopped {stopped * 1000:.0f} ms of every {period * 1000:.0f} ms"
    if a in ("broker_kill", "broker_restart", "kill_leader"):
        assert t.kafka is not None
        node = await _leader(t) if a == "kill_leader" else t.kafka.nodes[int(p.get("node", 1)) - 1]
        sig = signal.SIGTERM if a == "broker_restart" else signal.SIGKILL
        await asyncio.to_thread(t.kafka.kill, node, sig)
        await asyncio.sleep(float(p.get("restart_after_s", 0)))
        t.kafka.start_node(node)
        return f"{'stopped' if sig == signal.SIGTERM else 'killed'} broker {node.node_id}, started it again"
    if a == "redis_kill":
        assert t.redis is not None
        await asyncio.to_thread(t.redis.kill)
        await asyncio.sleep(float(p.get("restart_after_s", 0)))
        await asyncio.to_thread(t.redis.start)
        return "killed Redis, started it again (empty)"
    if a == "redis_evict":
        assert t.redis is not None
        n = await asyncio.to_thread(t.redis.evict_all)
        return f"evicted all {n} Redis keys"
    if a in ("latency", "bandwidth", "cut"):
        assert t.proxy is not None
        link = p["link"]
        if a == "cut":
            await asyncio.to_thread(t.proxy.enable, link, False)
            try:
                await asyncio.sleep(float(p["for_s"]))
            finally:
                await asyncio.to_thread(t.proxy.enable, link, True)
            return f"cut {link} for {p['for_s']} s"
        attrs = ({"latency": int(p.get("latency_ms", 200)), "jitter": int(p.get("jitter_ms", 50))} if a == "latency"
                 else {"rate": int(p.get("rate_kb_s", 64))})
        names = [await asyncio.to_thread(t.proxy.add_toxic, link, a, attrs, stream) for stream in ("upstream", "downstream")]
        try:
            await asyncio.sleep(float(p["for_s"]))
        finally:
            for name in names:
                await asyncio.to_thread(t.proxy.remove_toxic, link, name)
        return f"{a} {attrs} on {link} for {p['for_s']} s"
    if a == "slow_reader":
        consumer = t.reader._transport._consumer  # noqa: SLF001 - the runner's own client
        consumer.pause(*consumer.assignment())
        try:
            await asyncio.sleep(float(p["for_s"]))
        finally:
            consumer.resume(*consumer.assignment())
        return f"reply reader paused for {p['for_s']} s"
    raise ValueError(f"unknown fault action {a!r}")


def _victim(supervisor: Supervisor, stage: str, replica: int) -> WorkerProc:
    live = [w for w in supervisor.workers() if w.stage == stage and w.alive]
    chosen = [w for w in live if w.replica == replica] or live
    if not chosen:
        raise RuntimeError(f"no live {stage} worker to fault")
    return chosen[0]


def _restart(supervisor: Supervisor, w: WorkerProc) -> None:
    count = max([x.replica for x in supervisor.workers() if x.stage == w.stage] + [w.replica]) + 1
    supervisor.start({w.stage: count})


async def _leader(t: Targets) -> Any:
    """The node leading partition 0 of the scenario's busiest topic (its fan-in topic)."""
    assert t.kafka is not None
    admin = AIOKafkaAdminClient(bootstrap_servers=t.kafka.bootstrap, **t.security)
    await admin.start()
    try:
        described = await admin.describe_topics([t.leader_topic])
        leader = next(p["leader"] for p in described[0]["partitions"] if p["partition"] == 0)
    finally:
        await admin.close()
    return next(n for n in t.kafka.nodes if n.node_id == leader)
