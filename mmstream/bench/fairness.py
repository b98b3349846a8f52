"""The fairness workload's traffic and report (``mmstream bench --workload fairness``). Pure
but for the sample PNG it builds once: no clocks, no Kafka, no Redis (``fairness_run`` sends
it and samples the processes).

Two tenants on the shared plaintext ingress (where the request's ``tenant`` is believed):

- the **victim** (tenant B) sends ordinary rt text embeds: ``text_request`` on Poisson
  arrivals at the run's rate, seeded as the text workload is; the same arrival times in
  both phases, the texts of each phase their own (the reuse cache, keyed by tenant and
  content, must not answer the second phase from the first);
- the **abuser** (tenant A) sends, at ``abuse_rate``, the worst request validation lets
  through, in one of ``ABUSE_SHAPES`` on the rt or the bulk lane, each with the longest
  deadline allowed. ``AbuseBounds`` reads the bounds from the settings, so A stays inside
  what the router validates and is turned away by admission and quotas, not as invalid.

A run is two phases of the same length: B alone, then B while A floods (``fairness_run``).
``victim_comparison``, ``abuser_summary``, ``memory_summary``, ``load_summary`` and
``verdict`` turn what was measured into the run's JSON; ``text_table`` prints it short.
"""

from __future__ import annotations

import functools
import io
import math
import random
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mmstream.bench.workloads import WORDS, arrival_offsets, text_request
from mmstream.stats import summary
from schemas.request import Lane, Limits, Modality, Params, Part, Request, Task
from schemas.settings import Settings

ABUSE_SHAPES = ("max_text", "max_images", "ref_fanout", "max_generate")
"""What the abuser sends: ``max_text`` (the most text parts, each at the text bound, the
request under the ingress bound), ``max_images`` (the most inline PNGs at the pixel bound
that fit one request), ``ref_fanout`` (every part a ref to one stored blob at the size that
puts the request at its ref-bytes cap: the router prices each part at the blob's size) and
``max_generate`` (max_tokens at its bound, the longest prompt that leaves room for them in
the context; only where a generator runs)."""

REQUEST_OVERHEAD_BYTES = 16 * 1024
"""Room left under ``max_request_bytes`` for the request's own fields and framing."""
GENERATE_PROMPT_WORDS = 800
"""About 900 tokens of SmolLM2's tokenizer with the system prompt (measured: 700 words of
``WORDS`` render to 802), so prompt + max_tokens 1024 fit its 2048-token context."""
RATIO_BOUND = 1.5
"""The issue's target: B's rt p99 under the flood at most this times its p99 alone."""
TAG_KEYWORD = b"mmstream-bench"
LOSS_MARGIN_S = 5.0
"""How long past its deadline an answer may take (the assembler's sweep, the broker) before
the request counts as lost."""
PLATEAU_MB_PER_S = 1.0
"""A process whose RSS rises faster than this over the second half of the flood is still
growing: its memory is not held by a bound (a bounded one levels off once its queues fill)."""


@dataclass(frozen=True, slots=True)
class AbuseBounds:
    """The bounds the abuser's requests sit on, from the settings the router validates with."""

    max_parts: int
    max_text_bytes: int
    max_inline_bytes: int
    max_request_bytes: int
    max_image_pixels: int
    max_ref_bytes: int
    max_request_ref_bytes: int
    max_tokens: int
    max_deadline_ms: int

    @classmethod
    def from_settings(cls, settings: Settings) -> "AbuseBounds":
        lim = settings.limits
        return cls(max_parts=lim.max_parts, max_text_bytes=lim.max_text_bytes, max_inline_bytes=lim.max_inline_bytes,
                   max_request_bytes=lim.max_request_bytes, max_image_pixels=lim.max_image_pixels,
                   max_ref_bytes=lim.max_ref_bytes, max_request_ref_bytes=lim.max_request_ref_bytes,
                   max_tokens=Limits().max_tokens, max_deadline_ms=lim.max_deadline_ms)

    @property
    def image_side(self) -> int:
        """The side of the largest square image within the pixel bound."""
        return math.isqrt(self.max_image_pixels)

    @property
    def blob_bytes(self) -> int:
        """Size of the ref blob: one part's share of the per-request ref cap, at most one ref's."""
        return min(self.max_ref_bytes, self.max_request_ref_bytes // self.max_parts)

    @property
    def text_part_bytes(self) -> int:
        """Bytes of each ``max_text`` part: the text bound, or less where all of them would
        take the request past the ingress bound."""
        room = (self.max_request_bytes - REQUEST_OVERHEAD_BYTES) // self.max_parts - 64
        return max(1, min(self.max_text_bytes, room))


@dataclass(frozen=True, slots=True)
class AbuseItem:
    """One planned abuser request: when, what shape, which lane, and the tag its content is
    made unique by (so neither reuse cache answers it)."""

    offset_s: float
    shape: str
    lane: str
    tag: int


def victim_schedule(seed: int, rate: float, duration_s: float, phase: str) -> tuple[list[float], list[Request]]:
    """B's arrivals and requests in ``phase`` (``alone`` or ``flood``): the same offsets in
    every phase (a function of seed, rate and duration), texts drawn per phase."""
    offsets = arrival_offsets(rate, duration_s, random.Random(f"{seed}:{rate}:victim"))
    rng = random.Random(f"{seed}:{rate}:victim:{phase}")
    return offsets, [text_request(rng, "rt") for _ in offsets]


def abuser_plan(seed: int, abuse_rate: float, duration_s: float, shapes: Sequence[str]) -> list[AbuseItem]:
    """A's requests as a plan (the requests themselves are megabytes: ``abuse_request``
    builds each when it is sent), a function of its arguments only."""
    unknown = [s for s in shapes if s not in ABUSE_SHAPES]
    if unknown or not shapes:
        raise ValueError(f"abuse shapes must be some of {', '.join(ABUSE_SHAPES)}, got {list(shapes)}")
    rng = random.Random(f"{seed}:{abuse_rate}:abuser")
    return [AbuseItem(t, rng.choice(shapes), rng.choice(("rt", "bulk")), rng.getrandbits(64))
            for t in arrival_offsets(abuse_rate, duration_s, rng)]


def abuse_request(item: AbuseItem, tenant: str, bounds: AbuseBounds, blob_ref: str,
                  deadline_ms: int | None = None) -> Request:
    """The request ``item`` plans, as ``tenant``, on the bounds; ``blob_ref`` (``redis:<key>``)
    names the blob ``ref_fanout`` parts point at (stored once, ``bounds.blob_bytes`` long).
    ``deadline_ms``: None for the longest allowed (work that may wait longest)."""
    rid = f"abuse-{item.tag:016x}"
    common = dict(id=rid, tenant=tenant, lane=Lane(item.lane), deadline_ms=deadline_ms or bounds.max_deadline_ms)
    if item.shape == "max_text":
        size = bounds.text_part_bytes
        parts = tuple(Part(Modality.TEXT, text=_filler(f"{item.tag:016x}.{i} ", size)) for i in range(bounds.max_parts))
        return Request(parts=parts, **common)
    if item.shape == "max_images":
        png = pixel_bound_png(bounds.image_side)
        tagged = [_png_chunk(png, b"tEXt", TAG_KEYWORD + b"\x00" + b"%016x.%d" % (item.tag, i))
                  for i in range(bounds.max_parts)]
        fits = max(1, (bounds.max_request_bytes - REQUEST_OVERHEAD_BYTES) // (len(tagged[0]) + 64))
        return Request(parts=tuple(Part(Modality.IMAGE, data=d, mime="image/png") for d in tagged[:fits]), **common)
    if item.shape == "ref_fanout":
        return Request(parts=tuple(Part(Modality.IMAGE, ref=blob_ref, mime="image/png")
                                   for _ in range(bounds.max_parts)), **common)
    if item.shape == "max_generate":
        text = _words(random.Random(item.tag), GENERATE_PROMPT_WORDS)[: bounds.max_text_bytes]
        return Request(task=Task.GENERATE, parts=(Part(Modality.TEXT, text=text),),
                       params=Params(max_tokens=bounds.max_tokens), **common)
    raise ValueError(f"unknown abuse shape {item.shape!r}")


def ref_blob(bounds: AbuseBounds) -> bytes:
    """The ``ref_fanout`` blob: the pixel-bound PNG padded by a private chunk (which decoders
    read past) to ``bounds.blob_bytes``, so every part costs a read of that size and a decode
    at the pixel bound."""
    png = pixel_bound_png(bounds.image_side)
    pad = bounds.blob_bytes - len(png) - 12
    return _png_chunk(png, b"mmPd", bytes(max(0, pad))) if pad > 0 else png


@functools.lru_cache(maxsize=2)
def pixel_bound_png(side: int) -> bytes:
    """A ``side`` x ``side`` RGB PNG of one colour: the most pixels a decoder is allowed to
    produce (PNG, unlike JPEG, cannot be decoded at a reduced scale) for the fewest bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 120, 40)).save(buf, "PNG", compress_level=9)
    return buf.getvalue()


def _png_chunk(png: bytes, kind: bytes, data: bytes) -> bytes:
    """``png`` with a chunk of ``kind`` holding ``data`` after its header chunk (IHDR ends at
    byte 33): the same pixels, other bytes."""
    chunk = len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    return png[:33] + chunk + png[33:]


@functools.lru_cache(maxsize=1)
def _corpus() -> str:
    """Words enough for any text part (ASCII, so its bytes are its characters)."""
    return _words(random.Random(0), 2 * 64 * 1024 // 6)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _filler(prefix: str, size: int) -> str:
    """``size`` bytes of words starting with ``prefix``; the corpus is repeated as needed."""
    corpus = _corpus()
    body = (corpus * (size // len(corpus) + 1))[: max(0, size - len(prefix))]
    text = (prefix + body)[:size]
    return text if text.strip() else "x" * size


# -- the report (pure) --------------------------------------------------------------------


def victim_comparison(alone: Mapping[str, Any], flood: Mapping[str, Any]) -> dict[str, Any]:
    """B's rt e2e in each phase (``build_run`` runs), their ratio per percentile (flood /
    alone; None where a phase answered nothing) and what B lost."""
    a, f = alone["by_lane"].get("rt", {}).get("e2e", {}), flood["by_lane"].get("rt", {}).get("e2e", {})
    ratio = {q: (round(f[q] / a[q], 3) if a.get(q) and f.get(q) is not None else None) for q in ("p50", "p95", "p99")}
    return {"alone_ms": {q: a.get(q) for q in ("p50", "p95", "p99")},
            "flood_ms": {q: f.get(q) for q in ("p50", "p95", "p99")},
            "ratio": ratio, "bound": RATIO_BOUND,
            "p99_within_bound": ratio["p99"] is not None and ratio["p99"] <= RATIO_BOUND,
            "sent": {"alone": alone["requests"]["sent"], "flood": flood["requests"]["sent"]},
            "errors": {"alone": alone["requests"]["errors"], "flood": flood["requests"]["errors"]},
            "lost": {"alone": alone["requests"]["lost"], "flood": flood["requests"]["lost"]}}


def shed_cause(code: str | None, message: str) -> str:
    """Which limit an ``overloaded`` answer came from, read from its message (the wire carries
    no reason): ``quota_rate``, ``quota_queued`` (the tenant's cap or fair share),
    ``quota_ref_bytes``, ``admission`` (a stage's queued work), ``generator`` (the TTFT
    bound), ``assembler``; the code itself for any other error, ``other`` when unrecognised."""
    if code != "overloaded":
        return code or "lost"
    m = message or ""
    if "requests per second" in m:
        return "quota_rate"
    if "bytes per" in m:
        return "quota_ref_bytes"
    if m.startswith("tenant ") and "ms of work" in m:
        return "quota_queued"
    if m.startswith("stage "):
        return "admission"
    if "generator" in m or "first token" in m:
        return "generator"
    if "assembler" in m or "tracking" in m:
        return "assembler"
    return "other"


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

    lines = [f"fairness: B {doc['config']['rate']:g} req/s rt text; A {a['offered_rate']:g} req/s offered "
             f"({', '.join(doc['abuse_shapes'])}), {doc['config']['duration_s']:g} s per phase",
             f"{'B rt e2e ms':<14}{'p50':>9}{'p95':>9}{'p99':>9}   lost"]
    quantiles = ("p50", "p95", "p99")
    for phase in ("alone", "flood"):
        ms = v[f"{phase}_ms"]
        lines.append(f"{phase:<14}" + "".join(f"{num(ms[q]):>9.1f}" for q in quantiles) + f"   {v['lost'][phase]}")
    lines.append(f"{'flood/alone':<14}" + "".join(f"{num(v['ratio'][q]):>8.2f}x" for q in quantiles)
                 + f"   (bound {v['bound']:g}x on p99)")
    lines.append(f"B errors: alone {v['errors']['alone']}, flood {v['errors']['flood']} (percentiles are of B's "
                 "answered requests)")
    lines.append(f"A: planned {a['planned']}, sent {a['sent']}, ok {a['ok']}, lost {a['lost']}, pending {a['pending']}; "
                 f"outcomes {a['by_outcome']}; causes {a['by_cause']}; "
                 f"overloaded with retry_after_ms {a['overloaded_with_retry_after']}")
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

