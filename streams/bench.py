"""`mmstream bench`: open-loop Poisson arrivals against the running pipeline.

Open loop: requests are sent on a schedule fixed by the seed, whether or not earlier ones
have been answered, so a slow pipeline shows up as queueing instead of a lower offered
rate. e2e is measured by the client (send -> terminal event received).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from schemas.request import Lane, Modality, Part, Request
from streams.client import Client, Submission, new_id
from streams.settings import Settings
from streams.stats import summary

WORDS = ("stream partition consumer latency model image token batch queue cache request encoder "
         "pipeline broker replica offset video audio text embedding vector kafka worker stage").split()


@dataclass(frozen=True)
class BenchConfig:
    workload: str = "text"
    rate: float = 20.0
    duration_s: float = 20.0
    drain_s: float = 30.0
    seed: int = 1
    lane: str = "rt"


def arrival_offsets(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival times (seconds from start) in [0, duration_s)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def text_request(rng: random.Random, lane: str) -> Request:
    """A text of 5 to 120 words (mostly short, like real queries), deterministic from rng."""
    n = min(120, max(5, int(rng.lognormvariate(2.6, 0.7))))
    text = " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."
    return Request(id=new_id(), parts=(Part(Modality.TEXT, text=text),), lane=Lane(lane))


async def run_bench(settings: Settings, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    if cfg.workload != "text":
        raise ValueError(f"unknown workload {cfg.workload!r}")
    rng = random.Random(cfg.seed)
    offsets = arrival_offsets(cfg.rate, cfg.duration_s, rng)
    requests = [text_request(rng, cfg.lane) for _ in offsets]
    subs: list[Submission] = []
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix) as client:
        waits: list[asyncio.Task] = []
        start = time.monotonic()
        bar = _Progress(len(offsets), enabled=progress)
        for offset, req in zip(offsets, requests):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sub = await client.submit(req)
            subs.append(sub)
            waits.append(asyncio.create_task(_wait(sub, cfg.duration_s + cfg.drain_s)))
            bar.advance()
        sent_elapsed = time.monotonic() - start
        await asyncio.wait(waits, timeout=cfg.drain_s) if waits else None
        for t in waits:
            t.cancel()
        bar.close()
    return _report(cfg, subs, sent_elapsed)


async def _wait(sub: Submission, timeout_s: float) -> None:
    try:
        await sub.result(timeout_s)
    except asyncio.TimeoutError:
        pass


def _report(cfg: BenchConfig, subs: list[Submission], sent_elapsed: float) -> dict[str, Any]:
    done = [s for s in subs if s.terminal is not None]
    ok = [s for s in done if s.terminal.kind == "result"]
    errors = Counter(s.terminal.error["code"] for s in done if s.terminal.kind == "error" and s.terminal.error)
    e2e = [s.terminal_at_ms - s.sent_at_ms for s in ok]
    stages: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"queued": [], "service": []})
    for s in ok:
        for st in (s.terminal.timings or {}).get("stages", []):
            stages[st["stage"]]["queued"].append(st["queued_ms"])
            stages[st["stage"]]["service"].append(st["service_ms"])
    if ok:
        first = min(s.sent_at_ms for s in ok)
        last = max(s.terminal_at_ms for s in ok)
        achieved = len(ok) / max(1e-9, (last - first) / 1000.0)
    else:
        achieved = 0.0
    e2e_summary = summary(e2e)
    engine = summary(stages["encode.text"]["service"]) if "encode.text" in stages else {"count": 0}
    overhead = (round(e2e_summary["p50"] - engine["p50"], 3)
                if e2e_summary.get("count") and engine.get("count") else None)
    return {
        "mode": "pipeline",
        "workload": cfg.workload,
        "config": asdict(cfg),
        "offered_rate": round(len(subs) / sent_elapsed, 3) if sent_elapsed > 0 else 0.0,
        "achieved_rate": round(achieved, 3),
        "requests": {"sent": len(subs), "ok": len(ok), "errors": dict(errors), "lost": len(subs) - len(done)},
        "latency_ms": {
            "text": {
                "e2e": e2e_summary,
                "stages": {name: {"queued": summary(v["queued"]), "service": summary(v["service"])}
                           for name, v in stages.items()},
            }
        },
        "overhead_ms": {"p50_e2e_minus_engine_service": overhead},
    }


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress

            # stderr: stdout carries the JSON report.
            self._p = Progress(console=Console(stderr=True), transient=True)
            self._p.start()
            self._task = self._p.add_task("sending", total=total)

    def advance(self) -> None:
        if self._p:
            self._p.advance(self._task)

    def close(self) -> None:
        if self._p:
            self._p.stop()
