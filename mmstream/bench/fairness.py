"""The fairness workload's report (``mmstream bench --workload fairness``): what the two
tenants got, from what ``fairness_run`` measured. Pure: no clocks, no Kafka, no Redis. What
they send is built in ``abuse``.

Two tenants on the shared plaintext ingress (where the request's ``tenant`` is believed): the
**victim** (tenant B) sends ordinary rt text embeds, the **abuser** (tenant A) the worst
requests validation lets through. A run is two phases of the same length: B alone, then B
while A floods. ``victim_comparison``, ``abuser_summary``, ``memory_summary``,
``load_summary`` and ``verdict`` turn what was measured into the run's JSON; ``text_table``
prints it short.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Mapping, Sequence

from mmstream.bench.results import shed_cause
from mmstream.stats import summary
from schemas.settings import Settings

RATIO_BOUND = 1.5
"""The issue's target: B's rt p99 under the flood at most this times its p99 alone."""
LOSS_MARGIN_S = 5.0
"""How long past its deadline an answer may take (the assembler's sweep, the broker) before
the request counts as lost."""
PLATEAU_MB_PER_S = 1.0
"""A process whose RSS rises faster than this over the second half of the flood is still
growing: its memory is not held by a bound (a bounded one levels off once its queues fill)."""


def victim_comparison(alone: Mapping[str, Any], flood: Mapping[str, Any]) -> dict[str, Any]:
    """B's rt e2e in each phase (``build_run`` runs), their ratio per percentile (flood /
    alone; None where a phase answered nothing) and what B lost."""
    a, f = alone["by_lane"].get("rt", {}).get("e2e", {}), flood["by_lane"].get("rt", {}).get("e2e", {})
    ratio = {q: (round(f[q] / a[q], 3) if a.get(q) and f.get(q) is not None else None) for q in ("p50", "p95", "p99")}
    return {"alone_ms": {q: a.get(q) for q in ("p50", "p95", "p99")},
            "flood_ms": {q: f.get(q) for q in ("p50", "p95", "p99")},
            "ratio": ratio, "bound": RATIO_BOUND,
            "p99_within_bound": ratio["p99"] is not None and ratio["p99"] <= RATIO_BOUND,
            "by_modality": {m: _modality_p99(alone, flood, m) for m in sorted(
                set(alone.get("latency_ms", {})) | set(flood.get("latency_ms", {})))},
            "sent": {"alone": alone["requests"]["sent"], "flood": flood["requests"]["sent"]},
            "errors": {"alone": alone["requests"]["errors"], "flood": flood["requests"]["errors"]},
            "lost": {"alone": alone["requests"]["lost"], "flood": flood["requests"]["lost"]}}


def _modality_p99(alone: Mapping[str, Any], flood: Mapping[str, Any], modality: str) -> dict[str, float | None]:
    """B's e2e p99 of one kind of request (``build_run``'s ``latency_ms`` key) in each phase, and their ratio."""
    a, f = (run.get("latency_ms", {}).get(modality, {}).get("e2e", {}).get("p99") for run in (alone, flood))
    return {"alone_p99_ms": a, "flood_p99_ms": f, "ratio": round(f / a, 3) if a and f is not None else None}


ADMITTED_LISTED = 20
"""A's requests the pipeline took on (answered ok, or still unanswered), listed by when they
were sent: when its heaviest admitted work began, beside B's slowest requests."""


def abuser_summary(records: Sequence[Mapping[str, Any]], duration_s: float, horizon_s: float | None = None,
                   deadline_s: float | None = None) -> dict[str, Any]:
    """A's outcomes: ``records`` are dicts with ``shape``, ``lane``, ``outcome`` (``ok``, an
    error code, or None: no terminal event), ``message``, ``retry_after_ms`` and ``sent_s``
    (seconds into the phase its produce was acknowledged; absent: never sent, A having
    fallen that far behind its plan). An unanswered request is ``lost`` when its deadline
    (``deadline_s`` after it was sent, plus ``LOSS_MARGIN_S``) passed before the wait for
    answers ended (``horizon_s`` into the phase), else ``pending``: still inside its deadline
    when the run stopped listening (any unanswered one is lost when either is None)."""
    sent = [r for r in records if r.get("sent_s") is not None]

    def unanswered(r: Mapping[str, Any]) -> str:
        if r.get("sent_s") is None:
            return "unsent"
        if horizon_s is None or deadline_s is None or r["sent_s"] + deadline_s + LOSS_MARGIN_S <= horizon_s:
            return "lost"
        return "pending"

    errors = [r for r in records if r["outcome"] not in (None, "ok")]
    overloaded = [r for r in errors if r["outcome"] == "overloaded"]
    by_shape: dict[str, Counter] = defaultdict(Counter)
    by_lane: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        outcome = r["outcome"] or unanswered(r)
        by_shape[r["shape"]][outcome] += 1
        by_lane[r["lane"]][outcome] += 1
    with_retry = [r for r in errors if r.get("retry_after_ms") is not None]
    admitted = [r for r in sent if r["outcome"] is None or r["outcome"] == "ok"]
    return {
        "planned": len(records),
        "sent": len(sent),
        "offered_rate": (round(sum(r["sent_s"] <= duration_s for r in sent) / duration_s, 3)
                         if duration_s > 0 else 0.0),
        "ok": sum(r["outcome"] == "ok" for r in records),
        "lost": sum(r["outcome"] is None and unanswered(r) == "lost" for r in records),
        "pending": sum(r["outcome"] is None and unanswered(r) == "pending" for r in records),
        "unsent": sum(r["outcome"] is None and r.get("sent_s") is None for r in records),
        "deadline_s": deadline_s,
        "by_outcome": dict(Counter(r["outcome"] or unanswered(r) for r in records)),
        "by_cause": dict(Counter(shed_cause(r["outcome"], r.get("message", "")) for r in errors)),
        "by_shape": {k: dict(v) for k, v in sorted(by_shape.items())},
        "by_lane": {k: dict(v) for k, v in sorted(by_lane.items())},
        "errors_with_retry_after": round(len(with_retry) / len(errors), 4) if errors else None,
        "overloaded_with_retry_after": (round(sum(r.get("retry_after_ms") is not None for r in overloaded)
                                              / len(overloaded), 4) if overloaded else None),
        "retry_after_ms": summary(r["retry_after_ms"] for r in with_retry),
        "admitted": [{"shape": r["shape"], "lane": r["lane"], "sent_s": r["sent_s"], "outcome": r["outcome"] or
                      unanswered(r)} for r in sorted(admitted, key=lambda r: r["sent_s"])[:ADMITTED_LISTED]],
    }


def memory_summary(samples: Sequence[tuple[float, str, Mapping[str, float]]],
                   bounds: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per process, RSS over the run from ``samples`` ((seconds since start, phase, {process:
    MiB})): mean and peak per phase, the last sample, growth (peak of the flood phase and
    its drain over the peak alone), the slope over the second half of the flood (MiB/s: still
    growing?), the series, and the process's configured bound from ``bounds``."""
    names = sorted({n for _, _, mb in samples for n in mb})
    out: dict[str, Any] = {}
    for name in names:
        series = [(t, phase, mb[name]) for t, phase, mb in samples if name in mb]
        per_phase = {}
        for phase in ("alone", "flood"):
            xs = [v for _, p, v in series if p == phase]
            per_phase[phase] = {"mean_mb": round(sum(xs) / len(xs), 1), "peak_mb": round(max(xs), 1)} if xs else {}
        flood = [(t, v) for t, p, v in series if p == "flood"]
        peak_alone = per_phase["alone"].get("peak_mb")
        peak_flood = per_phase["flood"].get("peak_mb")
        out[name] = {
            **per_phase,
            "end_mb": round(series[-1][2], 1),
            "growth_mb": round(peak_flood - peak_alone, 1) if peak_alone is not None and peak_flood is not None else None,
            "flood_slope_mb_per_s": _slope(flood[len(flood) // 2:]),
            "bound": dict(bounds.get(name.split("[")[0], {})) or None,
            "series": [[round(t, 2), round(v, 1)] for t, _, v in series],
        }
        bound_mb = (out[name]["bound"] or {}).get("mb")
        if bound_mb is not None:
            out[name]["within_bound"] = max(v for _, _, v in series) <= bound_mb
    return out


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, y) points; None with fewer than 3."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return round(sum((t - mt) * (y - my) for t, y in points) / var, 3) if var else None


def load_summary(samples: Sequence[tuple[float, str, Mapping[str, Mapping[str, float]]]]) -> dict[str, Any]:
    """Per encoder replica, what its load reports said it held (``queued_ms`` all lanes,
    ``queued_rt_ms`` what an rt item waits behind), peak and mean per phase: the stage that
    queued."""
    names = sorted({n for _, _, rep in samples for n in rep})
    out: dict[str, Any] = {}
    for name in names:
        row: dict[str, Any] = {}
        for phase in ("alone", "flood"):
            reps = [rep[name] for _, p, rep in samples if p == phase and name in rep]
            row[phase] = {k: {"mean": round(sum(r[k] for r in reps) / len(reps), 1), "peak": round(max(r[k] for r in reps), 1)}
                          for k in ("queued_ms", "queued_rt_ms")} if reps else {}
        out[name] = row
    return out


def verdict(victim: Mapping[str, Any], abuser: Mapping[str, Any], memory: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's four conditions, each true or false, and whether all hold."""
    checks = {
        "victim_p99_within_bound": bool(victim["p99_within_bound"]),
        "victim_lost_nothing": victim["lost"]["alone"] == 0 and victim["lost"]["flood"] == 0,
        "abuser_lost_nothing": abuser["lost"] == 0,
        "abuser_shed_with_retry_after": bool(abuser["by_outcome"].get("overloaded"))
                                        and abuser["overloaded_with_retry_after"] == 1.0,
        "memory_within_bounds": all(m.get("within_bound", True) for m in memory.values()),
        "memory_plateaued": all((m["flood_slope_mb_per_s"] or 0.0) <= PLATEAU_MB_PER_S for m in memory.values()),
    }
    return {**checks, "all": all(checks.values())}


def text_table(doc: Mapping[str, Any]) -> str:
    """A few lines a person reads after the run (stderr; stdout carries the JSON)."""
    v, a = doc["victim"], doc["abuser"]
    nan = float("nan")

    def num(x: float | None) -> float:
        return nan if x is None else x

    kinds = "text" if not doc["config"].get("victim_images") else f"text, {doc['config']['victim_images']:.0%} photos"
    lines = [f"fairness: B {doc['config']['rate']:g} req/s rt {kinds}; A {a['offered_rate']:g} req/s offered "
             f"({', '.join(doc['abuse_shapes'])}), {doc['config']['duration_s']:g} s per phase",
             f"{'B rt e2e ms':<14}{'p50':>9}{'p95':>9}{'p99':>9}   lost"]
    quantiles = ("p50", "p95", "p99")
    for phase in ("alone", "flood"):
        ms = v[f"{phase}_ms"]
        lines.append(f"{phase:<14}" + "".join(f"{num(ms[q]):>9.1f}" for q in quantiles) + f"   {v['lost'][phase]}")
    lines.append(f"{'flood/alone':<14}" + "".join(f"{num(v['ratio'][q]):>8.2f}x" for q in quantiles)
                 + f"   (bound {v['bound']:g}x on p99)")
    if len(v.get("by_modality", {})) > 1:
        for kind, m in v["by_modality"].items():
            lines.append(f"  {kind + ' p99':<12}{num(m['alone_p99_ms']):>9.1f} alone {num(m['flood_p99_ms']):>9.1f} flood "
                         f"{num(m['ratio']):>6.2f}x")
    lines.append(f"B errors: alone {v['errors']['alone']}, flood {v['errors']['flood']} (percentiles are of B's "
                 "answered requests)")
    flood = doc.get("phases", {}).get("flood", {}).get("slowest", [])
    if flood:
        lines.append("B's slowest in the flood (sent at s: e2e ms = the bench's own lag, then stage "
                     "queued+service ..., then the answer's way back):")
        lines.extend(f"  {r['kind']:<6}{r['sent_s']:>7.2f}: {r['e2e_ms']:>6.0f} = "
                     + (f"bench {r['submit_lag_ms']:.0f} " if r.get("submit_lag_ms") is not None else "")
                     + " ".join(f"{st['stage']} {st['queued_ms']:.0f}+{st['service_ms']:.0f}" for st in r["stages"])
                     + (f" return {r['return_ms']:.0f}" if r.get("return_ms") is not None else "")
                     for r in flood)
    lines.append(f"A: planned {a['planned']}, sent {a['sent']}, ok {a['ok']}, lost {a['lost']}, pending {a['pending']}; "
                 f"outcomes {a['by_outcome']}; causes {a['by_cause']}; "
                 f"overloaded with retry_after_ms {a['overloaded_with_retry_after']}")
    if a.get("admitted"):
        lines.append("A's admitted (sent at s): " + ", ".join(f"{r['shape']} {r['sent_s']:.2f}" for r in a["admitted"]))
    lines.append(f"{'process':<18}{'alone peak':>11}{'flood peak':>11}{'growth':>8}{'end':>8}  bound")
    for name, m in doc["memory"].items():
        bound = ", ".join(f"{k}={val}" for k, val in (m["bound"] or {}).items())
        lines.append(f"{name:<18}{num(m['alone'].get('peak_mb')):>11.1f}{num(m['flood'].get('peak_mb')):>11.1f}"
                     f"{num(m['growth_mb']):>8.1f}{m['end_mb']:>8.1f}  {bound}")
    lines.append("verdict: " + ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in doc["verdict"].items()
                                         if k != "all"))
    return "\n".join(lines)


def stage_bounds(settings: Settings) -> dict[str, dict[str, Any]]:
    """The configured bound of each process kind (a stage, the broker, Redis): items held
    where that is what is bounded, ``mb`` where a size in MiB is (Redis's maxmemory; the
    broker's heap, which its RSS exceeds by the JVM's own, so it is named apart)."""
    enc = {"max_queue_jobs": settings.encoder.max_queue}
    out: dict[str, dict[str, Any]] = {
        "router": {"max_tenants": settings.quota.max_tenants},
        "assembler": {"max_pending": settings.assembler.max_pending, "max_orphans": settings.assembler.max_orphans},
        "generate": {"max_queued_jobs": settings.generator.max_queued,
                     "kv_cache_tokens": settings.generator.kv_cache_tokens},
        "encode.video": {"max_held_jobs": settings.video.max_held},
        "redis": {"mb": settings.local.redis_maxmemory_mb},
        "broker": {"heap_mb": settings.local.kafka_heap_mb},
    }
    for stage in ("encode.text", "encode.image", "encode.audio"):
        out[stage] = dict(enc)
    return out

