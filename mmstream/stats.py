"""Percentiles for reports (nearest-rank on sorted samples; no interpolation surprises)."""

from __future__ import annotations

import math
from typing import Iterable


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of already-sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def summary(values: Iterable[float]) -> dict[str, float | int]:
    """count, mean, p50, p95, p99 and max, rounded to microseconds; count 0 when empty."""
    xs = sorted(values)
    if not xs:
        return {"count": 0}
    return {
        "count": len(xs),
        "mean": round(sum(xs) / len(xs), 3),
        "p50": round(percentile(xs, 50), 3),
        "p95": round(percentile(xs, 95), 3),
        "p99": round(percentile(xs, 99), 3),
        "max": round(xs[-1], 3),
    }
