"""A run over time: what a rate schedule (``--rate-schedule``) needs beside its percentiles.

``windows`` cuts a run's records into fixed windows by the time each was due and reports per
window the offered rate, outcomes, and the p50/p99 of the answered rt text requests (the
latency the autoscaling target speaks of). ``Sampler`` records, once a second, how many
replicas of each stage are alive (the supervisor's pid files): the replicas-over-time line.
``settle`` reads the two: after each step of the schedule, how long until text p99 was back
under a bound (``None``: not within the run). Pure except ``Sampler``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

from mmstream.bench.results import Record


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 1)


def windows(records: Iterable[Record], start_ms: float, width_s: float = 5.0) -> list[dict[str, Any]]:
    """One entry per window from the first to the last due record: ``t`` (seconds from start),
    ``offered`` (req/s), ``outcomes``, ``text_p50_ms``/``text_p99_ms`` (answered rt text) and
    ``p50_ms``/``p99_ms`` (every answered request, of any kind and lane)."""
    by: dict[int, list[Record]] = {}
    for r in records:
        by.setdefault(int((r.sent_at_ms - start_ms) / 1000.0 // width_s), []).append(r)
    out = []
    for i in range(max(by) + 1 if by else 0):
        mine = by.get(i, [])
        ok = [r for r in mine if r.outcome == "ok" and r.done_at_ms is not None]
        text = [r.done_at_ms - r.sent_at_ms for r in ok if r.lane == "rt" and r.parts == ("text",)]
        every = [r.done_at_ms - r.sent_at_ms for r in ok]
        out.append({"t": round(i * width_s, 1), "offered": round(len(mine) / width_s, 2),
                    "outcomes": dict(Counter(r.outcome or "lost" for r in mine)),
                    "text_p50_ms": _pct(text, 0.50), "text_p99_ms": _pct(text, 0.99),
                    "p50_ms": _pct(every, 0.50), "p99_ms": _pct(every, 0.99)})
    return out


def settle(wins: Sequence[dict[str, Any]], steps_at_s: Sequence[float], bound_ms: float = 500.0) -> list[float | None]:
    """Per step of the schedule: seconds from the step to the start of the first window from
    which text p99 stays at or under ``bound_ms`` until the next step (``None``: never)."""
    out: list[float | None] = []
    ends = [*steps_at_s[1:], math.inf]
    for at, end in zip(steps_at_s, ends):
        span = [w for w in wins if at <= w["t"] < end]
        found = None
        for i, w in enumerate(span):
            if all(x["text_p99_ms"] is None or x["text_p99_ms"] <= bound_ms for x in span[i:]):
                found = round(w["t"] - at, 1)
                break
        out.append(found)
    return out


class Sampler:
    """Counts live replicas per stage once a second while running (``start``/``stop``), and
    hands the live workers it read to ``also`` (in a thread): the bench reads their CPU there,
    so a replica that stops before the end still counts."""

    def __init__(self, supervisor: Any, also: Callable[[list[Any]], None] | None = None,
                 every_s: float = 1.0) -> None:
        self.supervisor, self.also, self.every_s = supervisor, also, every_s
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self, t0: float) -> None:
        while True:
            workers = [w for w in await asyncio.to_thread(self.supervisor.workers) if w.alive]
            live = Counter(w.stage for w in workers)
            self.samples.append({"t": round(time.monotonic() - t0, 1), **dict(sorted(live.items()))})
            if self.also is not None:
                await asyncio.to_thread(self.also, workers)
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(time.monotonic()))

    async def stop(self) -> list[dict[str, Any]]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.samples
