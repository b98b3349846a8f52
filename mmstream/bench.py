"""`mmstream bench`: open-loop Poisson arrivals against the running pipeline, or against the
monolithic baseline (``mmstream.monolith``) fed by the very same schedule.

Open loop: requests are sent on a schedule fixed by the seed, whether or not earlier ones
have been answered, so a slow server shows up as queueing instead of a lower offered
rate. e2e is measured by the client (send -> terminal event received) in pipeline mode,
and from arrival in the queue to the batch's end in monolithic mode.

Both modes draw the same arrival times and the same requests from ``seed``, and both
state ``floor_ms``: each engine's service time alone at batch 1, measured in this process
before the run, so a report can say how much of the latency is not compute.

Output: one run dict per rate (schema in ``mmstream.report.BENCH_SCHEMA``); a sweep
(several rates) returns ``{"mode", "workload", "seed", "runs": [run, ...]}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import logging
import os
import random
import resource
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from mmstream import report, samples
from mmstream.levers import own_pipeline
from mmstream.monolith import Engines, FifoLimits, Monolith
from mmstream.stats import summary
from mmstream.supervisor import Supervisor
from schemas.request import Lane, Modality, Params, Part, Request, Task
from schemas.settings import Settings
from streams.client import Client, Submission, new_id

log = logging.getLogger(__name__)

WORDS = ("stream partition consumer latency model image token batch queue cache request encoder "
         "pipeline broker replica offset video audio text embedding vector kafka worker stage").split()

MODES = ("pipeline", "monolithic")
WORKLOADS = ("text", "mixed", "chat")
SCHEDULERS = ("continuous", "static")
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three colours.",
    "Explain in two sentences what a Kafka consumer group is.",
    "Summarize this for a colleague: {context}",
    "Write a short haiku about {topic}.",
    "Which is larger, an elephant or a mouse? Answer in one sentence.",
)
# Request kinds of the mixed workload and their shares (text-only, text + 1 image, text + 2).
MIXED_KINDS = (("text", 0.45), ("text+image", 0.25), ("text+2images", 0.05), ("text+video", 0.2),
               ("text+audio", 0.05))
"""The design scenario: about half text-only, 30% with images, 20% with a video, a share of audio."""
SAMPLE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")
FLOOR_TEXT_WORDS = 13  # the median length of `text_request` (e^2.6 words)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark invocation: a workload at one or several offered rates, in one mode."""

    workload: str = "text"
    """``text`` (one text part) or ``mixed`` (``MIXED_KINDS``)."""
    rate: float = 20.0
    """Offered requests per second (used when ``rates`` is empty)."""
    duration_s: float = 20.0
    """Seconds of arrivals per rate."""
    drain_s: float = 30.0
    """Seconds to wait for stragglers after the last arrival; unanswered ones count as lost."""
    seed: int = 1
    """Seeds arrivals and requests: the same seed gives both modes the same schedule."""
    lane: str = "rt"
    mode: str = "pipeline"
    """``pipeline`` (the running workers, over Kafka) or ``monolithic`` (``mmstream.monolith``)."""
    rates: tuple[float, ...] = ()
    """A sweep: one run per rate, in order. Empty: just ``rate``."""
    max_batch_size: int | None = None
    """Monolith's fixed batch size; None: ``settings.encoder.max_batch_size`` (as the encoders)."""
    max_wait_ms: float | None = None
    """Monolith's batch wait; None: ``settings.encoder.max_wait_ms`` (as the encoders)."""
    floor_repeats: int = 20
    """Batch-1 engine calls per engine for ``floor_ms`` (the median is reported)."""
    lanes: tuple[tuple[str, float], ...] = ()
    """Share of requests per lane, e.g. (("rt", 0.2), ("bulk", 0.8)). Empty: all on ``lane``."""
    repeat: float = 0.0
    """Share of requests whose content repeats an earlier request's (reuse-cache traffic)."""
    levers_off: tuple[str, ...] = ()
    """Levers switched off for this run (mmstream.levers.LEVERS); the run then gets a
    pipeline of its own with those settings."""
    scheduler: str | None = None
    """Chat workload: the generator's batching (continuous or static); the run then gets a
    pipeline of its own with that setting. None: whatever the running pipeline uses."""
    chat_max_tokens: int = 32
    own_pipeline: bool = False
    """Run against a fresh pipeline started for this run, even with every lever on."""
    tenant: str | None = None
    """Tenant of the pipeline's requests. None: a fresh one per run, so the reuse cache
    (keyed by tenant) cannot answer from an earlier run and the modes compare compute
    with compute; the ``cache`` counts of the run say what it answered within the run."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; workloads: {', '.join(WORKLOADS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")
        if any(r <= 0 for r in self.sweep) or self.duration_s <= 0:
            raise ValueError("rates and duration must be positive")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; schedulers: {', '.join(SCHEDULERS)}")
        if not 0.0 <= self.repeat < 1.0:
            raise ValueError("repeat must be in [0, 1)")
        if self.lanes and (any(lane not in ("rt", "bulk") or share < 0 for lane, share in self.lanes)
                           or abs(sum(share for _, share in self.lanes) - 1.0) > 1e-6):
            raise ValueError("lanes must be rt/bulk shares adding up to 1, e.g. rt=0.2,bulk=0.8")

    @property
    def sweep(self) -> tuple[float, ...]:
        return tuple(self.rates) or (self.rate,)


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


def parse_rates(text: str) -> tuple[float, ...]:
    """``"5,10,20"`` -> ``(5.0, 10.0, 20.0)``; raises ``ValueError`` on anything else."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        rates = ()
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates takes positive numbers separated by commas, got {text!r}")
    return rates


def arrival_offsets(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival times (seconds from start) in [0, duration_s)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _text(rng: random.Random, n: int | None = None) -> str:
    n = n if n is not None else min(120, max(5, int(rng.lognormvariate(2.6, 0.7))))
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def text_request(rng: random.Random, lane: str) -> Request:
    """A text of 5 to 120 words (mostly short, like real queries), deterministic from rng."""
    return Request(id=new_id(), parts=(Part(Modality.TEXT, text=_text(rng)),), lane=Lane(lane))


@functools.lru_cache(maxsize=1)
def sample_images() -> tuple[tuple[bytes, str], ...]:
    """JPEG bytes (quality 90) of scikit-image's sample photos: the same bytes every call and
    every run. Raises ``RuntimeError`` naming the package when scikit-image is missing."""
    try:
        import skimage.data
    except ImportError:
        raise RuntimeError("the mixed workload needs scikit-image (pip install scikit-image)") from None
    from PIL import Image

    out = []
    for name in SAMPLE_PHOTOS:
        buf = io.BytesIO()
        Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(buf, "JPEG", quality=90)
        out.append((buf.getvalue(), "image/jpeg"))
    return tuple(out)


def chat_request(rng: random.Random, lane: str, max_tokens: int = 32) -> Request:
    """A generate request: a question of mixed length (some carry a context paragraph).
    Every prompt starts with the same system prompt (the prompt builder's), which is what
    the prefix cache reuses."""
    template = rng.choice(CHAT_PROMPTS)
    text = template.format(context=_text(rng, rng.randint(20, 120)), topic=rng.choice(WORDS))
    return Request(id=new_id(), task=Task.GENERATE, parts=(Part(Modality.TEXT, text=text),), lane=Lane(lane),
                   params=Params(max_tokens=max_tokens), deadline_ms=120_000)


def mixed_request(rng: random.Random, lane: str) -> Request:
    """A text part plus photos, a short video or a spoken clip with the shares of
    ``MIXED_KINDS``. Every medium is bytes of its own (a tag in the JPEG comment or the
    video's corner; a different sentence), so the reuse cache does not answer across
    requests unless ``repeat`` asks for it."""
    x, kind = rng.random(), MIXED_KINDS[-1][0]
    acc = 0.0
    for name, share in MIXED_KINDS:
        acc += share
        if x < acc:
            kind = name
            break
    parts = [Part(Modality.TEXT, text=_text(rng))]
    images = sample_images()
    n_images = {"text+image": 1, "text+2images": 2}.get(kind, 0)
    for _ in range(n_images):
        data, mime = images[rng.randrange(len(images))]
        parts.append(Part(Modality.IMAGE, data=_with_comment(data, rng.getrandbits(64)), mime=mime))
    if kind == "text+video":
        names = tuple(rng.choice(SAMPLE_PHOTOS) for _ in range(4))
        parts.append(Part(Modality.VIDEO, data=_tagged_mp4(_clip(names), rng.getrandbits(64)), mime="video/mp4"))
    if kind == "text+audio":

        clip = samples.speech(_text(rng, rng.randint(5, 15)))
        if clip is None:
            raise RuntimeError("the mixed workload's audio needs espeak-ng (apt-get install espeak-ng)")
        parts.append(Part(Modality.AUDIO, data=clip, mime="audio/wav"))
    return Request(id=new_id(), parts=tuple(parts), lane=Lane(lane))


@functools.lru_cache(maxsize=64)
def _clip(names: tuple[str, ...]) -> bytes:
    """A 4-second MP4 slideshow of sample photos (built once per photo sequence)."""

    return samples.video(list(names))


def _tagged_mp4(mp4: bytes, tag: int) -> bytes:
    """``mp4`` with a trailing ``free`` box naming ``tag``: the same frames, bytes of their
    own (decoders skip ``free`` boxes), so a content-keyed cache sees a new video."""
    payload = f"mmstream-bench {tag:016x}".encode()
    return mp4 + (8 + len(payload)).to_bytes(4, "big") + b"free" + payload


def _with_comment(jpeg: bytes, tag: int) -> bytes:
    """``jpeg`` with a comment segment (COM) naming ``tag`` after its SOI marker: the same
    pixels, but bytes of their own, so a content-keyed cache sees a new image."""
    comment = f"mmstream-bench {tag:016x}".encode()
    return jpeg[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + jpeg[2:]


def request_kind(request: Request) -> str:
    """``text``, ``text+image`` or ``text+2images`` (any other mix: its modalities joined)."""
    n_images = sum(p.modality == Modality.IMAGE for p in request.parts)
    if all(p.modality in (Modality.TEXT, Modality.IMAGE) for p in request.parts) and len(request.parts) == n_images + 1:
        return ("text", "text+image", "text+2images")[n_images] if n_images < 3 else f"text+{n_images}images"
    return "+".join(str(p.modality) for p in request.parts)


def schedule(cfg: BenchConfig, rate: float) -> tuple[list[float], list[Request]]:
    """The arrival offsets and requests of one run: a function of (seed, rate, workload) only."""
    rng = random.Random(f"{cfg.seed}:{rate}")
    offsets = arrival_offsets(rate, cfg.duration_s, rng)
    if cfg.workload == "chat":
        requests = [chat_request(rng, cfg.lane, cfg.chat_max_tokens) for _ in offsets]
    else:
        make = text_request if cfg.workload == "text" else mixed_request
        requests = [make(rng, cfg.lane) for _ in offsets]
    shape = random.Random(f"{cfg.seed}:{rate}:shape")  # lanes and repeats, independent of content
    for i, req in enumerate(requests):
        lane = _pick_lane(shape, cfg.lanes) if cfg.lanes else cfg.lane
        parts = req.parts
        if cfg.repeat and i > 0 and shape.random() < cfg.repeat:
            parts = requests[shape.randrange(i)].parts
        requests[i] = dataclasses.replace(req, lane=Lane(lane), parts=parts)
    return offsets, requests


def _pick_lane(rng: random.Random, lanes: tuple[tuple[str, float], ...]) -> str:
    x, acc = rng.random(), 0.0
    for lane, share in lanes:
        acc += share
        if x < acc:
            return lane
    return lanes[-1][0]


def parse_lanes(text: str) -> tuple[tuple[str, float], ...]:
    """``"rt=0.2,bulk=0.8"`` -> ``(("rt", 0.2), ("bulk", 0.8))``; raises ``ValueError``."""
    out = []
    for item in text.split(","):
        lane, sep, share = item.partition("=")
        if not sep:
            raise ValueError(f"--lanes takes LANE=SHARE,..., got {text!r}")
        out.append((lane.strip(), float(share)))
    return tuple(out)


# -- process accounting --------------------------------------------------------------

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` from /proc/<pid>/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def proc_peak_rss_mb(pid: int) -> float | None:
    """Peak resident set (VmHWM) of ``pid`` since it started, in MiB; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError):
        pass
    return None


def _workers(settings: Settings) -> list[tuple[str, int]]:
    return [(f"{w.stage}[{w.replica}]", w.pid) for w in Supervisor(settings).workers() if w.alive]


# -- running ---------------------------------------------------------------------------


async def run_bench(settings: Settings, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg``: one run per rate of ``cfg.sweep``, each fed by ``schedule(cfg, rate)``.

    Loads the text engine (and the image engine for ``mixed``) in this process first to
    measure ``floor_ms``; monolithic mode then serves with them. Raises ``ValueError`` on a
    bad config, ``ClientError`` when the pipeline is not up (pipeline mode), and whatever
    loading a model raises.
    """

    mono = cfg.mode == "monolithic"
    engines = await asyncio.to_thread(Engines, settings, cfg.workload == "mixed",
                                      mono and cfg.workload == "mixed", mono and cfg.workload == "chat")
    floor = engines.floor_ms(_text(random.Random(0), FLOOR_TEXT_WORDS),
                             sample_images()[0] if cfg.workload == "mixed" else None, cfg.floor_repeats)
    runs = []
    for rate in cfg.sweep:
        if cfg.mode == "pipeline" and (cfg.levers_off or cfg.own_pipeline or cfg.scheduler):

            extra = {"MMSTREAM_GENERATOR_SCHEDULER": cfg.scheduler} if cfg.scheduler else {}
            async with own_pipeline(settings, cfg.levers_off, cfg.workload, extra_env=extra) as run_settings:
                run = await _run_pipeline(run_settings, cfg, rate, progress)
            run["levers_off"] = list(cfg.levers_off)
            if cfg.scheduler:
                run["scheduler"] = cfg.scheduler
        elif cfg.mode == "pipeline":
            run = await _run_pipeline(settings, cfg, rate, progress)
        else:
            run = await _run_monolith(settings, cfg, rate, engines, progress)
        run["floor_ms"] = floor
        run["engines"] = engines.info
        run["overhead_ms"] = overhead(run["latency_ms"], floor)
        runs.append(run)
    if len(runs) == 1:
        return runs[0]
    return {"mode": cfg.mode, "workload": cfg.workload, "seed": cfg.seed, "config": _config(cfg), "runs": runs}


async def _send_on_schedule(offsets: Sequence[float], requests: Sequence[Request],
                            send: Callable[[Request], Any], progress: bool) -> float:
    """Call ``send`` for each request at its offset; returns the seconds the sending took."""
    bar = _Progress(len(offsets), enabled=progress)
    start = time.monotonic()
    try:
        for offset, req in zip(offsets, requests):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            result = send(req)
            if asyncio.iscoroutine(result):
                await result
            bar.advance()
    finally:
        bar.close()
    return time.monotonic() - start


async def _run_pipeline(settings: Settings, cfg: BenchConfig, rate: float, progress: bool) -> dict[str, Any]:
    offsets, requests = schedule(cfg, rate)
    tenant = cfg.tenant or f"bench-{new_id()[:12]}"
    requests = [dataclasses.replace(r, tenant=tenant) for r in requests]
    workers = _workers(settings)
    if not workers:
        log.warning("no local workers for topic prefix %r: CPU and RSS will be empty (pipeline elsewhere?)",
                    settings.kafka.topic_prefix)
    pairs: list[tuple[Request, Submission]] = []
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix) as client:
        waits: list[asyncio.Task] = []
        cpu0 = {name: proc_cpu_s(pid) for name, pid in workers}
        own0 = time.process_time()

        async def send(req: Request) -> None:
            sent = dataclasses.replace(req, lane=Lane.RT) if "lanes" in cfg.levers_off else req
            sub = await client.submit(sent)
            pairs.append((req, sub))
            waits.append(asyncio.create_task(_wait(sub, cfg.duration_s + cfg.drain_s)))

        sent_s = await _send_on_schedule(offsets, requests, send, progress)
        if waits:
            await asyncio.wait(waits, timeout=cfg.drain_s)
        for t in waits:
            t.cancel()
        cpu1 = {name: proc_cpu_s(pid) for name, pid in workers}
        own_cpu_s = time.process_time() - own0
    records = [_pipeline_record(req, sub) for req, sub in pairs]
    worker_cpu = {n: round(cpu1[n] - cpu0[n], 3) for n in cpu0 if cpu0[n] is not None and cpu1.get(n) is not None}
    ok = sum(r.outcome == "ok" for r in records)
    cpu = {
        "scope": "sum of the pipeline workers' processes (broker and client excluded)",
        "total_s": round(sum(worker_cpu.values()), 3),
        "per_process_s": worker_cpu,
        "client_s": round(own_cpu_s, 3),
    }
    cpu["per_request_ms"] = round(cpu["total_s"] * 1000.0 / ok, 3) if ok else None
    rss = {name: proc_peak_rss_mb(pid) for name, pid in workers}
    run = build_run("pipeline", cfg, rate, records, sent_s, cpu, rss)
    cache = [sub.terminal.cache or {} for _, sub in pairs if sub.terminal is not None]
    hits, misses = sum(int(c.get("hits", 0)) for c in cache), sum(int(c.get("misses", 0)) for c in cache)
    run["cache"] = {"tenant": tenant, "hits": hits, "misses": misses,
                    "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}
    return run


async def _wait(sub: Submission, timeout_s: float) -> None:
    try:
        await sub.result(timeout_s)
    except asyncio.TimeoutError:
        pass


def _pipeline_record(req: Request, sub: Submission) -> Record:
    rec = Record(request_kind(req), tuple(str(p.modality) for p in req.parts), sub.sent_at_ms, lane=str(req.lane))
    t = sub.terminal
    if t is None:
        return rec
    rec.done_at_ms = sub.terminal_at_ms
    if t.kind == "result":
        rec.outcome = "ok"
    else:
        rec.outcome = (t.error or {}).get("code", "internal")
    rec.stages = [dict(s) for s in (t.timings or {}).get("stages", [])]
    rec.ttft_ms = (t.timings or {}).get("ttft_ms")
    c = t.cache or {}
    if c.get("hits") or c.get("misses"):
        rec.cache = "miss" if c.get("misses") else "hit"
    rec.tpot_ms = (t.timings or {}).get("tpot_ms")
    return rec


async def _run_monolith(settings: Settings, cfg: BenchConfig, rate: float, engines: Any,
                        progress: bool) -> dict[str, Any]:

    offsets, requests = schedule(cfg, rate)
    limits = FifoLimits(cfg.max_batch_size or settings.encoder.max_batch_size,
                        (cfg.max_wait_ms if cfg.max_wait_ms is not None else settings.encoder.max_wait_ms) / 1000.0)
    mono = Monolith(engines, limits)
    cpu0 = time.process_time()
    server = asyncio.create_task(mono.run())
    sent_s = await _send_on_schedule(offsets, requests, mono.submit, progress)
    mono.close()
    try:
        await asyncio.wait_for(asyncio.shield(server), cfg.drain_s)
    except asyncio.TimeoutError:
        pass  # what is still queued counts as lost; the thread finishes its batch and stops
    cpu_s = time.process_time() - cpu0
    records = []
    for o in mono.outcomes:
        rec = Record(request_kind(o.request), tuple(str(p.modality) for p in o.request.parts), o.arrived_at_ms,
                     lane=str(o.request.lane), ttft_ms=o.ttft_ms, tpot_ms=o.tpot_ms)
        if o.finished_at_ms is not None:
            rec.done_at_ms = o.finished_at_ms
            rec.outcome = "ok" if len(o.errors) < len(o.request.parts) else "internal"
            rec.stages = list(o.spans)
        records.append(rec)
    ok = sum(r.outcome == "ok" for r in records)
    cpu = {"scope": "the bench process (monolith and its arrival loop)", "total_s": round(cpu_s, 3),
           "per_process_s": {"monolith": round(cpu_s, 3)},
           "per_request_ms": round(cpu_s * 1000.0 / ok, 3) if ok else None}
    rss = {"monolith": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}
    run = build_run("monolithic", cfg, rate, records, sent_s, cpu, rss)
    run["batch_size"] = summary(mono.batch_sizes)
    run["batching"] = {"max_batch_size": limits.max_batch_size, "max_wait_ms": limits.max_wait_s * 1000.0}
    if not server.done():
        server.cancel()
    return run


# -- the report of one run ---------------------------------------------------------------


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
        "config": {**_config(cfg), "rate": rate},
        "offered_rate": round(len(records) / sent_s, 3) if sent_s > 0 else 0.0,
        "achieved_rate": round(len(ok) / window_s, 3) if window_s else 0.0,
        "requests": {"sent": len(records), "ok": len(ok), "errors": dict(errors),
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
        "by_cache": {outcome: summary([r.done_at_ms - r.sent_at_ms for r in ok if r.cache == outcome])
                     for outcome in ("hit", "miss")},
        "generation": {"ttft_ms": summary([r.ttft_ms for r in ok if r.ttft_ms is not None]),
                       "tpot_ms": summary([r.tpot_ms for r in ok if r.tpot_ms is not None])},
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


def _config(cfg: BenchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["rates"] = list(cfg.sweep)
    return d


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


# -- command line -------------------------------------------------------------------------


def config_from_args(args: Any) -> BenchConfig:
    """A ``BenchConfig`` from the parsed ``mmstream bench`` arguments (see ``cli_main``).
    Raises ``ValueError`` on a bad value."""
    return BenchConfig(workload=args.workload, rate=args.rate, duration_s=args.duration, drain_s=args.drain,
                       seed=args.seed, lane=args.lane, mode=args.mode,
                       rates=parse_rates(args.rates) if args.rates else (),
                       max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                       lanes=parse_lanes(args.lanes) if getattr(args, "lanes", None) else (),
                       repeat=getattr(args, "repeat", 0.0) or 0.0,
                       levers_off=tuple(lv for lv in ("routing", "cache", "admission", "lanes")
                                        if getattr(args, f"no_{lv}", False)),
                       own_pipeline=getattr(args, "own_pipeline", False),
                       scheduler=getattr(args, "scheduler", None))


def cli_main(args: Any, settings: Settings) -> int:
    """``mmstream bench [run] ...`` and ``mmstream bench compare A.json [B.json] --report DIR``.

    run: runs the benchmark, prints the JSON (and writes it to ``--out``), and with
    ``--report DIR`` writes the report there; exits 1 when a request was lost.
    compare: validates the given JSONs and writes the report of all of them to ``--report``
    (default ``bench-report``); exits 2 when one does not validate.
    """
    import json
    import sys
    from pathlib import Path


    if getattr(args, "action", "run") == "compare":
        try:
            if not args.inputs:
                raise ValueError("bench compare needs one or more bench JSON files")
            docs = [_read_json(Path(p)) for p in args.inputs]
            path = report.write_report(docs, Path(args.report or "bench-report"),
                                       labels=_compare_labels(docs, [Path(p) for p in args.inputs]))
        except (ValueError, OSError) as exc:  # BenchSchemaError is a ValueError
            print(f"mmstream: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"mmstream: {exc}", file=sys.stderr)
        return 2
    doc = asyncio.run(run_bench(settings, cfg))
    report.validate(doc)
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    print(text)  # stdout carries the JSON only
    if args.report:
        print(f"wrote {report.write_report([doc], Path(args.report))}", file=sys.stderr)
    runs = doc.get("runs", [doc])
    return 0 if all(r["requests"]["lost"] == 0 for r in runs) else 1


def _read_json(path: Any) -> Any:
    import json

    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None


def _compare_labels(docs: list[dict[str, Any]], paths: list[Any]) -> list[str]:
    modes = [d.get("mode", "?") for d in docs]
    return [m if modes.count(m) == 1 else f"{m} ({p.stem})" for m, p in zip(modes, paths)]
