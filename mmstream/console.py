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
    """A rich Table: one row per request (label, terminal event, client-measured e2e ms)."""
    from rich.table import Table

    stages: list[str] = []
    for _, ev, _ in rows:
        for s in stage_times(ev):
            if s not in stages:
                stages.append(s)
    # Pipeline order: route first, encoders in between, assemble last.
    stages.sort(key=lambda s: (s != "route", s == "assemble", s))
    table = Table(title="latency per request (ms): queued / service per stage")
    table.add_column("request")
    table.add_column("outcome")
    for s in stages:
        table.add_column(s, justify="right")
    table.add_column("e2e", justify="right")
    for label, ev, e2e in rows:
        times = stage_times(ev)
        outcome = ev.kind.value if not ev.error else f"error:{ev.error.get('code')}"
        cells = [f"{times[s][0]:.1f} / {times[s][1]:.1f}" if s in times else "-" for s in stages]
        table.add_row(label[:34], outcome, *cells, f"{e2e:.1f}")
    return table
