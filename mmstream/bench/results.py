"""The report of one bench run: each request's ``Record``, and the run's JSON built from them.

Pure: no clocks, no I/O. Both modes fill the same ``Record`` so one ``build_run`` reports
them alike; the JSON's shape is ``mmstream.report.RUN_SCHEMA`` (validated before it is
printed or compared).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from mmstream.bench.config import BenchConfig, config_dict
from mmstream.stats import summary


@dataclass
class Record:
    """One request's outcome, the same shape for both modes."""

    kind: str
    parts: tuple[str, ...]
    sent_at_ms: float
    done_at_ms: float | None = None
    outcome: str | None = None
    """``ok``, an error code, or None when nothing came back (lost)."""
    stages: list[dict[str, Any]] = field(default_factory=list)
    lane: str = "rt"
    """The lane the traffic assigned (with the lanes lever off it was sent on rt)."""
    ttft_ms: float | None = None
    """Generation: accepted -> first token event produced (the generator's measure)."""
    cache: str | None = None
    """``hit`` when every cached part was a reuse-cache hit, ``miss`` when any was computed."""
    tpot_ms: float | None = None
    completion_tokens: int = 0
    """Generation: tokens the answer has."""
    retry_after_ms: int | None = None
    """An ``overloaded`` answer's retry hint."""
    cause: str | None = None
    """Which limit refused it (``shed_cause``), for an error answer."""
    submitted_at_ms: float | None = None
    """When the client's submit was called: after ``sent_at_ms`` (the schedule) by as much as
    the load generator itself fell behind, time counted in e2e that no stage spent."""
    answered_at_ms: float | None = None
    """When the stage that answered built its terminal event (the event's ``ts_ms``): from
    there to ``done_at_ms`` is the answer's way back (that stage's produce, the broker, the
    client's fetch and loop), which no stage's span covers. Another host's clock when the
    pipeline runs elsewhere."""


def return_ms(r: Record) -> float | None:
    """How long ``r``'s answer took from the stage that built it to the client, or None."""
    if r.answered_at_ms is None or r.done_at_ms is None:
        return None
    return r.done_at_ms - r.answered_at_ms


def shed_cause(code: str | None, message: str) -> str:
    """Which limit an ``overloaded`` answer came from, read from its message (the wire carries
    no reason): ``quota_rate``, ``quota_queued`` (the tenant's cap or fair share),
    ``quota_ref_bytes``, ``quota_compute``, ``admission`` (a stage's queued work), ``encoder_wait`` (an
    encoder's rt wait bound: ``streams.cores.encoder``), ``generator`` (the TTFT bound), ``assembler``; the
    code itself for any other error, ``other`` when unrecognised."""
    if code != "overloaded":
        return code or "lost"
    m = message or ""
    if "requests per second" in m:
        return "quota_rate"
    if "bytes per" in m:
        return "quota_ref_bytes"
    if "engine ms per second" in m:
        return "quota_compute"
    if m.startswith("tenant ") and "ms of work" in m:
        return "quota_queued"
    if m.startswith("stage "):
        return "admission"
    if "waited" in m and "engine, past its bound" in m:
        return "encoder_wait"
    if "generator" in m or "first token" in m:
        return "generator"
    if "assembler" in m or "tracking" in m:
        return "assembler"
    return "other"


def build_run(mode: str, cfg: BenchConfig, rate: float, records: Sequence[Record], sent_s: float,
              cpu: dict[str, Any], rss_mb: dict[str, float | None]) -> dict[str, Any]:
    """The JSON of one run from its records (pure: no clocks, no I/O)."""
    done = [r for r in records if r.outcome is not None]
    ok = [r for r in done if r.outcome == "ok"]
    errors = Counter(r.outcome for r in done if r.outcome != "ok")
    by_kind: dict[str, list[Record]] = defaultdict(list)
    for r in ok:
        by_kind[r.kind].append(r)
    if ok:
        window_s = max(1e-9, (max(r.done_at_ms for r in ok) - min(r.sent_at_ms for r in ok)) / 1000.0)
    else:
        window_s = 0.0
    latency: dict[str, Any] = {}
    samples: dict[str, list[float]] = {}
    for kind, recs in sorted(by_kind.items()):
        e2e = [r.done_at_ms - r.sent_at_ms for r in recs]
        stages: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"queued": [], "service": []})
        for r in recs:
            for st in r.stages:
                stages[st["stage"]]["queued"].append(st["queued_ms"])
                stages[st["stage"]]["service"].append(st["service_ms"])
        latency[kind] = {"e2e": summary(e2e),
                         "stages": {name: {"queued": summary(v["queued"]), "service": summary(v["service"])}
                                    for name, v in stages.items()}}
        samples[kind] = [round(x, 3) for x in sorted(e2e)]
    parts = Counter(m for r in ok for m in r.parts)
    by_lane: dict[str, Any] = {}
    for lane in sorted({r.lane for r in records}):
        mine = [r for r in records if r.lane == lane]
        mine_ok = [r for r in mine if r.outcome == "ok"]
        by_lane[lane] = {
            "e2e": summary([r.done_at_ms - r.sent_at_ms for r in mine_ok]),
            "requests": {"sent": len(mine), "ok": len(mine_ok),
                         "errors": dict(Counter(r.outcome for r in mine if r.outcome not in (None, "ok"))),
                         "lost": sum(r.outcome is None for r in mine)},
        }
    return {
        "mode": mode,
        "workload": cfg.workload,
        "config": {**config_dict(cfg), "rate": rate},
        "offered_rate": round(len(records) / sent_s, 3) if sent_s > 0 else 0.0,
        "achieved_rate": round(len(ok) / window_s, 3) if window_s else 0.0,
        "requests": {"sent": len(records), "ok": len(ok), "errors": dict(errors),
                     "by_cause": dict(Counter(r.cause for r in done if r.cause is not None)),
                     "lost": len(records) - len(done)},
        "latency_ms": latency,
        "by_lane": by_lane,
        "throughput": {
            "requests_per_s": {k: round(len(v) / window_s, 3) for k, v in sorted(by_kind.items())} if window_s else {},
            "parts_per_s": {m: round(n / window_s, 3) for m, n in sorted(parts.items())} if window_s else {},
        },
        "cpu": cpu,
        "peak_rss_mb": rss_mb,
        "samples_ms": {"e2e": samples},
        "slowest": slowest(ok),
        "client": {"submit_lag_ms": summary([r.submitted_at_ms - r.sent_at_ms for r in records
                                             if r.submitted_at_ms is not None]),
                   "return_ms": summary([x for x in map(return_ms, ok) if x is not None])},
        "by_cache": {outcome: summary([r.done_at_ms - r.sent_at_ms for r in ok if r.cache == outcome])
                     for outcome in ("hit", "miss")},
        "generation": {"ttft_ms": summary([r.ttft_ms for r in ok if r.ttft_ms is not None]),
                       "tpot_ms": summary([r.tpot_ms for r in ok if r.tpot_ms is not None]),
                       "ttft_ms_by_lane": {lane: summary([r.ttft_ms for r in ok if r.ttft_ms is not None and r.lane == lane])
                                           for lane in sorted({r.lane for r in ok if r.ttft_ms is not None})},
                       "tokens_per_s": round(sum(r.completion_tokens for r in ok) / window_s, 3) if window_s else 0.0,
                       "overloaded_with_retry_after": sum(1 for r in done if r.outcome == "overloaded"
                                                          and r.retry_after_ms is not None)},
    }


def overhead(latency: dict[str, Any], floor: dict[str, float]) -> dict[str, Any]:
    """Latency beyond pure compute, per request kind (milliseconds, at p50 and p95).

    ``total``: e2e minus the compute floor of the kind's parts run one after another at
    batch 1 (a text kind's floor is the text engine's; ``text+2images`` adds two image
    floors). ``hops``: per engine stage, queue + service minus that engine's floor: what
    one hop costs beyond the engine itself.
    """
    out: dict[str, Any] = {}
    for kind, lat in latency.items():
        n_images = {"text": 0, "text+image": 1, "text+2images": 2}.get(kind)
        if n_images is None or not lat["e2e"].get("count"):
            continue
        base = floor.get("encode.text", 0.0) + n_images * floor.get("encode.image", 0.0)
        hops = {}
        for stage, st in lat["stages"].items():
            if stage in floor and st["service"].get("count"):
                hops[stage] = {q: round(st["queued"][q] + st["service"][q] - floor[stage], 3) for q in ("p50", "p95")}
        out[kind] = {"floor_ms": round(base, 3),
                     "total": {q: round(lat["e2e"][q] - base, 3) for q in ("p50", "p95")},
                     "hops": hops}
    return out



def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


SLOWEST_SHARE = 0.01
SLOWEST_MIN = 5


def slowest(ok: Sequence[Record]) -> list[dict[str, Any]]:
    """The slowest answered requests (the slowest 1%, at least five: those a p99 is made of),
    slowest first, each with when it was sent (s after the run's first send), how late the
    load generator submitted it (``submit_lag_ms``), its stages' queued and service ms and how
    long its answer took to reach the client once built (``return_ms``):
    where a tail's milliseconds went, and whether its requests came together."""
    if not ok:
        return []
    start = min(r.sent_at_ms for r in ok)
    n = max(SLOWEST_MIN, int(len(ok) * SLOWEST_SHARE + 0.999))
    worst = sorted(ok, key=lambda r: r.done_at_ms - r.sent_at_ms, reverse=True)[:n]
    return [{"kind": r.kind, "sent_s": round((r.sent_at_ms - start) / 1000.0, 3),
             "e2e_ms": round(r.done_at_ms - r.sent_at_ms, 3),
             "submit_lag_ms": round(r.submitted_at_ms - r.sent_at_ms, 3) if r.submitted_at_ms is not None else None,
             "return_ms": _rounded(return_ms(r)),
             "stages": [{"stage": st["stage"], "queued_ms": round(st["queued_ms"], 3),
                         "service_ms": round(st["service_ms"], 3)} for st in r.stages]}
            for r in worst]
