"""`mmstream chaos run FILE...`: each scenario on a pipeline of its own, faults fired while its
traffic flows, then every invariant of ``checks.py``. Exit 0 only when all of them held in
every scenario.

A run: its own infrastructure where the scenario asks (``infra.py``: never the shared broker
or Redis for faults that touch them), the topics under a fresh prefix, the workers
(``Supervisor``), a probe until the pipeline answers, then traffic and the fault schedule
together; afterwards it waits for the answers, the lag to drain and the state to empty,
reads the reply topic and writes one ``ChaosResult`` (the row of docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmstream.chaos import checks, faults, ingest, timeline, traffic
from mmstream.chaos.infra import OwnKafka, OwnRedis, Toxiproxy, free_port, toxiproxy_binary
from mmstream.chaos.scenario import Scenario
from mmstream.supervisor import Supervisor
from schemas.settings import Settings
from streams.sdk.client import Client, wait_until_serving
from streams.connection import KafkaSecurity, client_kwargs
from schemas.topics import TopicNames
from streams.runtime.parent import PARENT_PID_ENV
from streams.topics import collection_spec, ensure_topics, topic_specs

log = logging.getLogger(__name__)

SETTLE_S = 3.0
"""After the last answer: a duplicate sent right after the first would land by then."""
RETENTION_MS = 5_000
"""The assembler's and generator's memory of answered ids in a chaos run: short, so the
"state back to empty" check can wait it out."""


@dataclass
class ChaosResult:
    scenario: str
    requests: int
    faults: list[str]
    lost: int
    duplicated: int
    p99_fault_ms: float | None
    recover_s: float | None
    outcomes: dict[str, int]
    lag: dict[str, int]
    state_left: dict[str, dict[str, float]]
    dlq: int
    rss_peak_mb: dict[str, float]
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Per fault, where its seconds went (``timeline.breakdown``)."""
    index: str = ""
    """With ``documents``: what the check of the index against the collection topic found."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def row(self) -> str:
        """The scenario's line in docs/reliability.md's table."""
        p99 = "–" if self.p99_fault_ms is None else f"{self.p99_fault_ms / 1000:.1f} s"
        rec = "–" if self.recover_s is None else f"{self.recover_s:.1f} s"
        return (f"| {self.scenario} | {self.requests} | {'; '.join(self.faults)} | {self.lost} | {self.duplicated} "
                f"| {p99} | {rec} | {'pass' if self.ok else 'FAIL'} |")


async def run(settings: Settings, scenario: Scenario, repo_root: Path, workdir: Path | None = None) -> ChaosResult:
    root = Path(workdir or tempfile.mkdtemp(prefix=f"chaos-{scenario.name}-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    kafka = redis = proxy = None
    env = {**os.environ, "MMSTREAM_KAFKA_TOPIC_PREFIX": f"chaos{uuid.uuid4().hex[:8]}",
           "MMSTREAM_KAFKA_PARTITIONS": str(scenario.partitions), "MMSTREAM_LOCAL_METRICS_BASE_PORT": "0",
           "MMSTREAM_ASSEMBLER_RETENTION_MS": str(RETENTION_MS),
           "MMSTREAM_GENERATOR_DONE_RETENTION_MS": str(RETENTION_MS),
           "MMSTREAM_LOCAL_STATE_DIR": str(root / "state"), PARENT_PID_ENV: str(os.getpid()), **scenario.env}
    try:
        if scenario.proxy:
            proxy = Toxiproxy(toxiproxy_binary(settings), root)
            proxy.start()
        if scenario.broker != "shared":
            kafka = OwnKafka(settings, repo_root, root, nodes=3 if scenario.broker == "cluster" else 1,
                             proxied=scenario.proxy)
            if proxy is not None:
                node = kafka.nodes[0]
                proxy.add_proxy("kafka", node.advertised_port, f"127.0.0.1:{node.port}")
            await asyncio.to_thread(kafka.start)
            env["MMSTREAM_KAFKA_BOOTSTRAP"] = kafka.bootstrap
            env["MMSTREAM_KAFKA_REPLICATION_FACTOR"] = str(kafka.replication)
        if scenario.redis == "own":
            redis = OwnRedis(settings, repo_root, root / "redis")
            await asyncio.to_thread(redis.start)
            url = redis.url
            if proxy is not None:
                port = free_port()
                proxy.add_proxy("redis", port, f"127.0.0.1:{redis.port}")
                url = f"redis://127.0.0.1:{port}/0"
            env["MMSTREAM_REDIS_URL"] = url
        run_settings = Settings.from_env(env)
        return await _run_pipeline(run_settings, env, scenario, kafka, redis, proxy, started, root)
    finally:
        for thing in (kafka, redis, proxy):
            if thing is not None:
                await asyncio.to_thread(thing.stop)


async def _run_pipeline(settings: Settings, env: dict[str, str], scenario: Scenario, kafka: OwnKafka | None,
                        redis: OwnRedis | None, proxy: Toxiproxy | None, started: float,
                        root: Path) -> ChaosResult:
    k = settings.kafka
    names = TopicNames(k.topic_prefix)
    docs = scenario.documents
    await ensure_topics(k.bootstrap, topic_specs(k) + ([collection_spec(k, "default", docs.collection)] if docs else []),
                        k.replication_factor)
    supervisor = Supervisor(settings, env)
    await asyncio.to_thread(supervisor.start, scenario.replicas)
    peaks: dict[str, float] = {}
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(checks.sample_rss(supervisor, peaks, stop_sampling))
    cpu: list[dict[str, float]] = []
    brokers = (lambda: [n.pid for n in kafka.nodes if n.pid]) if kafka is not None else (lambda: [])
    cpu_sampler = asyncio.create_task(checks.sample_cpu(supervisor, brokers, cpu, stop_sampling))
    try:
        await wait_until_serving(k.bootstrap, k.topic_prefix, 300)
        # Every worker, not only those one probe passes through (a generator loads its model
        # last): traffic meets a started pipeline, so a fault's cost is not its start-up's.
        unready = await checks.wait_workers_ready(supervisor, 300)
        if unready:
            log.warning("chaos: workers not ready before traffic: %s", ", ".join(unready))
        media = await asyncio.to_thread(traffic.make_media, scenario)
        async with Client(k.bootstrap, k.topic_prefix, redis_url=settings.redis.url,
                          inline_limit_bytes=traffic.INLINE_LIMIT_BYTES,
                          security=KafkaSecurity.from_settings(settings.kafka)) as client:
            targets = faults.Targets(supervisor, kafka, redis, proxy, client, leader_topic=names.encoded("rt"),
                                     security=client_kwargs(settings))
            t0 = time.monotonic()
            windows: list[tuple[float, float]] = []
            fired: list[tuple[str, float, float]] = []
            done_lines: list[str] = []

            async def fire(f: Any) -> None:
                await asyncio.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
                begin = time.monotonic()
                try:
                    done_lines.append(await faults.apply(f, targets))
                except Exception as exc:  # a fault that could not be fired is a failed run, said plainly
                    done_lines.append(f"FAILED {f.describe()}: {exc!r}")
                windows.append((begin, time.monotonic()))
                fired.append((f.describe(), begin, time.monotonic()))

            fault_tasks = [asyncio.create_task(fire(f)) for f in scenario.faults]
            writing = asyncio.create_task(ingest.write(client, docs, t0)) if docs else None
            sent = await traffic.send_all(client, scenario, media, t0)
            await asyncio.gather(*fault_tasks)
            await traffic.follow(sent, scenario.drain_s)
            index_violations, index_found = (await ingest.check(client, docs, await writing, scenario.drain_s)
                                             if docs and writing else ([], ""))
        await asyncio.sleep(SETTLE_S)
        ids = [s.id for s in sent if s.sub is not None]
        wire = await checks.read_wire(k.bootstrap, names.results, set(ids))
        violations, lost, duplicated = checks.wire_violations(wire, ids, scenario.errors)
        violations += [line for line in done_lines if line.startswith("FAILED")]
        violations += index_violations
        lag = await checks.wait_lag_drained(k.bootstrap, k.topic_prefix, 60, client_kwargs(settings))
        if any(lag.values()):
            violations.append(f"lag not drained: {lag}")
        state = await checks.wait_state_empty(supervisor, RETENTION_MS / 1000 + 30)
        if state:
            violations.append(f"state not back to empty after retention: {state}")
        dlq = await checks.dlq_count(k.bootstrap, names.dlq)
        if dlq != scenario.dlq:
            violations.append(f"{dlq} dead letters, expected {scenario.dlq}")
        over = {w: round(mb) for w, mb in peaks.items() if mb > scenario.rss_mb}
        if over:
            violations.append(f"RSS over {scenario.rss_mb:.0f} MB: {over}")
        p99, recover = checks.summarize_latency(sent, windows)
        where = _write_timeline(root, sent, fired, cpu)
        outcomes: dict[str, int] = {}
        for s in sent:
            key = "not sent" if s.sub is None else (s.outcome or "none")
            outcomes[key] = outcomes.get(key, 0) + 1
        return ChaosResult(scenario.name, len(ids), [f.describe() for f in scenario.faults], lost, duplicated, p99,
                           recover, outcomes, lag, state, dlq, {w: round(mb) for w, mb in peaks.items()},
                           violations, round(time.monotonic() - started, 1), where, index_found)
    finally:
        stop_sampling.set()
        await sampler
        await cpu_sampler
        await asyncio.to_thread(supervisor.stop, 10.0)


def _write_timeline(root: Path, sent: list[traffic.Sent], fired: list[tuple[str, float, float]],
                    cpu: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Write the run's faults, requests and CPU samples on the wall clock (``faults.json``,
    ``requests.json``, ``cpu.json``) next to the workers' logs, and return
    ``timeline.breakdown`` of them ([] if it fails)."""
    shift = time.time() - time.monotonic()
    try:
        (root / "cpu.json").write_text(json.dumps(cpu))
        (root / "faults.json").write_text(json.dumps(
            [{"fault": d, "begin": b + shift, "end": e + shift} for d, b, e in sorted(fired, key=lambda x: x[1])]))
        (root / "requests.json").write_text(json.dumps(
            [{"id": s.id, "kind": s.kind, "lane": s.lane, "outcome": s.outcome,
              "sent": s.sent_at + shift if s.sub is not None else None,
              "answered": s.answered_at + shift if s.answered_at else None} for s in sent]))
        return timeline.breakdown(root)
    except Exception as exc:  # the breakdown is a report; it never fails a run
        log.warning("chaos: no timeline for this run: %r", exc)
        return []


def to_json(result: ChaosResult) -> dict[str, Any]:
    return {**asdict(result), "ok": result.ok}


def print_result(result: ChaosResult) -> None:
    print(json.dumps(to_json(result), indent=1), flush=True)
