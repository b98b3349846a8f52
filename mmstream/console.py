"""Printing events for people: JSON lines with binary fields summarized, and the latency
table of `mmstream demo`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from schemas.events import Event
from schemas.tensor import from_wire


def summarize(value: Any) -> Any:
    """Replace tensors and bytes with short summaries, recursively."""
    if isinstance(value, dict):
        if {"dtype", "shape", "data"} <= value.keys():
            try:
                arr = from_wire(value).astype(np.float32)
                return {"dtype": value["dtype"], "shape": value["shape"], "norm": round(float(np.linalg.norm(arr)), 4),
                        "head": [round(float(x), 4) for x in arr.ravel()[:4]]}
            except ValueError:
                return {"tensor": "malformed"}
        return {k: summarize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [summarize(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return value


def event_line(event: Event) -> str:
    return json.dumps(summarize(event.to_wire()), ensure_ascii=False)


def stage_times(event: Event) -> dict[str, tuple[float, float]]:
    """stage -> (queued_ms, service_ms) from a terminal event's timings."""
    stages = (event.timings or {}).get("stages", [])
    return {s["stage"]: (s["queued_ms"], s["service_ms"]) for s in stages}


def latency_table(rows: list[tuple[str, Event, float]]) -> Any:
    """Rich tables that fit 80 columns, piped or not: one row per request (label, terminal
    event, client-measured e2e ms) with where its time went, then the median per stage.

    A column per stage would not fit once a request crosses four stages; instead each
    request names the stage it spent longest in (queued + service), and the second table
    has the per-stage detail. An error's outcome is its code."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    def table(title: str) -> Table:
        return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True,
                     pad_edge=False)

    requests = table("latency per request, ms (queued and service summed over its stages)")
    requests.add_column("request", overflow="ellipsis", no_wrap=True, max_width=21)
    requests.add_column("outcome", overflow="ellipsis", no_wrap=True, max_width=17)
    for col in ("e2e", "queued", "service"):
        requests.add_column(col, justify="right", no_wrap=True, min_width=6)
    requests.add_column("most in", no_wrap=True, min_width=12)
    per_stage: dict[str, list[tuple[float, float]]] = {}
    for label, ev, e2e in rows:
        times = stage_times(ev)
        for stage, qs in times.items():
            per_stage.setdefault(stage, []).append(qs)
        outcome = ev.kind.value if not ev.error else str(ev.error.get("code"))
        slowest = max(times, key=lambda s: sum(times[s]), default="-")
        requests.add_row(label, outcome, _ms(e2e), _ms(sum(q for q, _ in times.values())),
                         _ms(sum(sv for _, sv in times.values())), slowest)
    stages = table("per stage, ms: median over the requests above")
    stages.add_column("stage", no_wrap=True)
    for col in ("requests", "queued", "service"):
        stages.add_column(col, justify="right", no_wrap=True)
    # Pipeline order: route first, encoders in between, assemble and generate last.
    for stage in sorted(per_stage, key=lambda s: (s != "route", s in ("assemble", "generate"), s)):
        qs = per_stage[stage]
        stages.add_row(stage, str(len(qs)), _ms(_median([q for q, _ in qs])), _ms(_median([v for _, v in qs])))
    return Group(requests, stages)


def _ms(x: float) -> str:
    """At most 6 characters: one decimal under 1000 ms, none above."""
    return f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
