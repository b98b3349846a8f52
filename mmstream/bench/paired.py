"""Paired rounds (``mmstream bench --vs server --rounds N``): the pipeline and a baseline run
one right after the other, N times per rate, and each round's ratios read side by side.

A shared box's speed drifts between runs by more than the effects worth measuring (docs/
capacity.md, "Stop 49": the in-process server alone spread 15-19 ms of CPU per request over
ten runs of the same traffic). A ratio of two runs made minutes apart carries that drift; a
ratio within a round carries less of it, and the median of the rounds' ratios says what the
spread around it is. Pure: the runs' JSON in, the pairing out.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

RATIOS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "cpu_per_request": lambda run: (run.get("cpu") or {}).get("per_request_ms"),
    "text_p50": lambda run: _e2e(run, "text", "p50"),
    "text_p95": lambda run: _e2e(run, "text", "p95"),
    "text_p99": lambda run: _e2e(run, "text", "p99"),
    "image_p99": lambda run: _e2e(run, "image", "p99"),
}
"""What each round compares: the pipeline's value over the baseline's (CPU ms per answered
request, e2e latency percentiles per request kind)."""

DIFFERENCES: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "text_p50_ms": lambda run: _e2e(run, "text", "p50"),
    "text_p95_ms": lambda run: _e2e(run, "text", "p95"),
}
"""And the milliseconds the pipeline's latency is over the baseline's (light load is bounded so:
a few ms over three hops, where a ratio of two small numbers says little)."""


def _e2e(run: dict[str, Any], kind: str, q: str) -> float | None:
    return ((run.get("latency_ms") or {}).get(kind) or {}).get("e2e", {}).get(q)


def pair(runs: Sequence[dict[str, Any]], mode: str, baseline: str) -> list[dict[str, Any]]:
    """Per rate (in the order the runs came), each round's ``mode`` run against its
    ``baseline`` run (runs carry ``config.rate``, ``mode`` and ``round``): the ratios of
    ``RATIOS`` per round, and their median, lowest and highest over the rounds. A round
    missing either side, or a value either side lacks, is left out of that ratio."""
    by_rate: dict[float, dict[int, dict[str, dict[str, Any]]]] = {}
    for run in runs:
        by_rate.setdefault(run["config"]["rate"], {}).setdefault(run.get("round", 1), {})[run["mode"]] = run
    out = []
    for rate, rounds in by_rate.items():
        rows = []
        for number in sorted(rounds):
            sides = rounds[number]
            if mode not in sides or baseline not in sides:
                continue
            row: dict[str, Any] = {"round": number}
            for name, read in RATIOS.items():
                ours, theirs = read(sides[mode]), read(sides[baseline])
                row[name] = round(ours / theirs, 3) if ours is not None and theirs else None
            for name, read in DIFFERENCES.items():
                ours, theirs = read(sides[mode]), read(sides[baseline])
                row[f"{name}_over"] = round(ours - theirs, 3) if ours is not None and theirs is not None else None
            rows.append(row)
        out.append({"rate": rate, "mode": mode, "baseline": baseline, "rounds": rows,
                    "ratios": _spread(rows, list(RATIOS)),
                    "over_ms": _spread(rows, [f"{name}_over" for name in DIFFERENCES])})
    return out


def _spread(rows: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for name in names:
        values = [r[name] for r in rows if r[name] is not None]
        if values:
            out[name] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
    return out


def text_table(paired: Sequence[dict[str, Any]]) -> str:
    """The pairing as lines for a terminal: per rate, the median and range of each ratio."""
    lines = []
    for p in paired:
        lines.append(f"{p['mode']} / {p['baseline']} at {p['rate']:g} req/s, {len(p['rounds'])} rounds:")
        for name, s in p["ratios"].items():
            lines.append(f"  {name:16s} median {s['median']:.2f}  ({s['min']:.2f}-{s['max']:.2f})")
        for name, s in p.get("over_ms", {}).items():
            lines.append(f"  {name:16s} median {s['median']:+.1f} ms  ({s['min']:+.1f} to {s['max']:+.1f})")
    return "\n".join(lines)
