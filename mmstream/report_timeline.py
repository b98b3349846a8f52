"""The over-time plot of runs with a rate schedule (``run["timeline"]``, ``mmstream.bench.timeline``):
text p99 per window (for a mix without rt text, every answered request's p99) against the
offered rate, and the live replicas of each stage, one colour per input, so a scaled run and a
fixed one read side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any


HELPERS = {"t", "autoscale", "spare"}
"""Not pools: the time column, the scaler itself, its warm spare."""


def plot(series: list[list[dict[str, Any]]], names: list[str], out_dir: Path, plt: Any) -> list[str]:
    timed = [(name, run["timeline"]) for name, runs in zip(names, series) for run in runs if run.get("timeline")]
    if not timed:
        return []
    fig, (lat, reps) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    rate = lat.twinx()
    for i, (name, t) in enumerate(timed):
        wins = t["windows"]
        xs = [w["t"] for w in wins]
        key, what = ("text_p99_ms", "rt text p99") if any(w.get("text_p99_ms") is not None for w in wins) \
            else ("p99_ms", "p99 of every answered request")  # a mix without rt text (audio, images)
        lat.plot(xs, [w[key] if w.get(key) is not None else float("nan") for w in wins],
                 marker=".", color=f"C{i}", label=f"{name}: {what}")
        if i == 0:
            rate.step(xs, [w["offered"] for w in wins], where="post", color="grey", alpha=0.5, label="offered")
        # the pools that changed: a flat line per fixed pool hides the one that moved
        stages = sorted(k for k in {k for s in t["replicas"] for k in s} - HELPERS
                        if len({s.get(k, 0) for s in t["replicas"]}) > 1)
        styles = ("-", "--", ":", "-.")
        for j, stage in enumerate(stages):
            reps.step([s["t"] for s in t["replicas"]], [s.get(stage, 0) for s in t["replicas"]], where="post",
                      color=f"C{i}", linestyle=styles[j % len(styles)], label=f"{name}: {stage}")
    lat.axhline(500, color="red", linewidth=0.8, alpha=0.6)
    lat.set(ylabel="p99 per 5 s window (ms, log)", yscale="log", title="latency and replicas over time")
    rate.set_ylabel("offered req/s")
    lat.legend(loc="upper left", fontsize="small")
    reps.set(xlabel="seconds from the first arrival", ylabel="live replicas (pools that changed)")
    reps.legend(fontsize="x-small", ncol=3)
    for ax in (lat, reps):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "timeline.png", dpi=100)
    plt.close(fig)
    return ["timeline.png"]
