"""The baseline the pipeline is measured against: a traditional monolithic server.

The same engines and models as the pipeline's encoders (``TextEncoder`` and
``ImageEncoder`` over ``OnnxEngine``, from the same model repository), in ONE process
behind ONE FIFO queue with fixed batching: collect up to ``max_batch_size`` requests or
until the oldest has waited ``max_wait_s``, run the whole batch (every text part in one
text-engine call, then every image part in one image-engine call), answer it, take the
next. No broker hop, no serialization, no per-modality pools: what the pipeline's
overhead is weighed against.

The batching policy is the pipeline's own (``streams.policies.batching.MicroBatcher``),
fed one lane whatever the request's lane, at a cost of one per request. With one lane the
batcher never switches lanes, and with unit costs its budget counts requests, so its
contract reads as strict FIFO: a batch is a prefix of the queue, at most
``max_batch_size`` long, taken when that many wait or when the oldest has waited
``max_wait_s``; every queued request is eventually taken. ``Monolith`` carries it out.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from mmstream.enginebench import median_ms
from schemas.request import Modality, Request, Task
from schemas.settings import Settings
from schemas.trace import now_ms
from streams.policies.batching import Batch, BatchLimits, MicroBatcher, Pending, Wait
from streams.cores.generation import GenerationCore, GenerationRequest
from streams.stages.generator import build_core, prompt_parts
from workers import prompt as P
from workers.audio import AudioEncoder
from workers.encoders import batch_dependent
from workers.engines import EngineOptions, load_engine
from workers.engines.lm_types import LMError, SamplingParams
from workers.image import ImageEncoder, load_labels
from workers.repository import ModelRepository
from workers.text import TextEncoder, TextPreprocessor
from workers.video import decode_video, extract_audio_wav

REQUEST_COST = 1.0
"""What one request weighs in the batcher: batches are bounded by count, as a monolith's are."""


@dataclass
class Outcome:
    """One request's life in the monolith (epoch milliseconds, like the pipeline's spans)."""

    request: Request
    arrived_at_ms: float
    spans: list[dict[str, Any]] = field(default_factory=list)
    """``{stage, queued_ms, service_ms}`` per engine call the request rode in, in order."""
    finished_at_ms: float | None = None
    errors: list[str] = field(default_factory=list)
    batch_size: int = 0
    ttft_ms: float | None = None
    """Generation: arrival to the first generated token (the monolith does not stream, so
    this is when the token existed, not when a client could have seen it)."""
    tpot_ms: float | None = None

    @property
    def e2e_ms(self) -> float:
        assert self.finished_at_ms is not None
        return self.finished_at_ms - self.arrived_at_ms


class Engines:
    """The text and image encoders of the pipeline, loaded and warmed in this process."""

    def __init__(self, settings: Settings, need_image: bool = True, need_media: bool = False,
                 need_lm: bool = False) -> None:
        """Text always; the image encoder for images and video frames; with ``need_media``
        the audio encoder and video decoding; with ``need_lm`` the generator's LM."""

        e = settings.encoder
        options = EngineOptions.from_settings(e)
        repo = ModelRepository(settings.models.repository)
        tcfg = repo.resolve(settings.models.text_model)
        tengine = load_engine(tcfg, e.precision, options, stage="encode.text")
        self.info = {"encode.text": _info(tengine.info)}
        self.text = TextEncoder(tengine, TextPreprocessor(tcfg.tokenizer_path, tcfg.max_length),
                                embedding_dim=tcfg.embedding_dim)
        # As the pipeline's text stage: a variant whose rows depend on their batch-mates runs rows alone.
        self.text_alone = batch_dependent(tcfg, tengine.precision)
        self.text.warmup()
        self.image = None
        if need_image:
            icfg = repo.resolve(settings.models.image_model)
            iengine = load_engine(icfg, e.precision, options, stage="encode.image")
            self.info["encode.image"] = _info(iengine.info)
            self.image = ImageEncoder(iengine, load_labels(icfg.directory / "labels.json"),
                                      max_pixels=settings.limits.max_image_pixels, embedding_dim=icfg.embedding_dim)
            self.image.warmup()
        self.settings = settings
        self.audio = None
        if need_media:

            acfg = repo.resolve(settings.models.audio_model)
            aengine = load_engine(acfg, settings.models.audio_precision, options, stage="encode.audio")
            self.info["encode.audio"] = _info(aengine.info)
            self.audio = AudioEncoder(aengine, max_seconds=settings.limits.max_audio_seconds)
            self.audio.warmup()
        self.lm: GenerationCore | None = None
        if need_lm:
            # The generator stage's own core (same engine, gate, scheduler and prompt builder).
            self.lm, self.tokenizer = build_core(settings)
            self.info["generate"] = _info(self.lm.engine.info)

    def floor_ms(self, text: str, image: tuple[bytes, str] | None, repeats: int = 20) -> dict[str, float]:
        """Median service time of each engine alone at batch 1 (encoder call included:
        tokenizing, or decoding and preprocessing the image), in milliseconds."""
        out = {"encode.text": median_ms(lambda: self.text.run_batch([text]), repeats)}
        if self.image is not None and image is not None:
            out["encode.image"] = median_ms(lambda: self.image.run_batch([image]), repeats)
        return out


def _info(info: Any) -> dict[str, str]:
    return {"model": info.model, "version": info.version, "precision": info.precision, "provider": info.provider}


class Monolith:
    """One FIFO queue, one engine thread, fixed batching (the pipeline's batcher, see above).

    ``submit`` is called from the event loop at each arrival; ``run`` serves until
    ``close`` and the queue is empty. Every submitted request gets exactly one ``Outcome``
    with ``finished_at_ms`` set (errors per part in ``errors``). ``clock`` gives monotonic
    seconds (a test may pass its own).
    """

    def __init__(self, engines: Engines, limits: BatchLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engines = engines
        self.limits = limits
        self.queue: deque[Pending[Outcome]] = deque()
        self.outcomes: list[Outcome] = []
        self.batch_sizes: list[int] = []
        self._batcher: MicroBatcher[Outcome] = MicroBatcher(limits)
        self._clock = clock
        self._wake = asyncio.Event()
        self._closed = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="monolith-engine")

    def submit(self, request: Request, due_ms: float | None = None) -> Outcome:
        """Queue ``request``; its latency counts from ``due_ms`` (its scheduled arrival) when given."""
        out = Outcome(request, now_ms() if due_ms is None else due_ms)
        self.outcomes.append(out)
        self.queue.append(Pending(out, REQUEST_COST, self._clock()))
        self._wake.set()
        return out

    def close(self) -> None:
        """No more arrivals: ``run`` returns once the queue is drained."""
        self._closed = True
        self._wake.set()

    def next_batch(self) -> list[Outcome] | Wait | None:
        """The requests to run now, taken off the head of the queue; ``Wait(until)`` while
        the oldest may still wait for company; None when the queue is empty."""
        decision = self._batcher.next_batch(self.queue, (), self._clock())
        if isinstance(decision, Batch):
            return [self.queue.popleft().item for _ in decision.items]
        return decision

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                decision = self.next_batch()
                if decision is None and self._closed:
                    return
                if isinstance(decision, list):
                    self.batch_sizes.append(len(decision))
                    await loop.run_in_executor(self._executor, self._run_batch, decision)
                    continue
                self._wake.clear()
                timeout = None if decision is None else max(0.0, decision.until - self._clock())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._executor.shutdown(wait=False)

    def _run_batch(self, batch: list[Outcome]) -> None:
        """Runs in the engine thread: every text part in one call, then every image part."""

        grounding: dict[tuple[int, int], dict[str, Any]] = {}  # (request, part) -> what the LM is told
        generate = [o for o in batch if o.request.task == Task.GENERATE]
        generating = {id(o) for o in generate}  # their text goes to the LM as it is
        for modality, stage in ((Modality.TEXT, "encode.text"), (Modality.IMAGE, "encode.image"),
                                (Modality.VIDEO, "encode.video"), (Modality.AUDIO, "encode.audio")):
            items = [(o, i, p) for o in batch for i, p in enumerate(o.request.parts) if p.modality == modality
                     and not (modality == Modality.TEXT and id(o) in generating)]
            if not items:
                continue
            started = now_ms()
            results = self._encode(modality, [p for _, _, p in items])
            finished = now_ms()
            for (o, i, _), r in zip(items, results):
                if isinstance(r, Exception):
                    o.errors.append(f"{stage}: {r}")
                if id(o) in generating:
                    grounding[(id(o), i)] = _grounding(modality, r)
            self._span([o for o, _, _ in items], stage, started, finished)
        if generate:
            self._generate(generate, grounding)
        done = now_ms()
        for o in batch:
            o.finished_at_ms = done
            o.batch_size = len(batch)

    def _encode(self, modality: Modality, parts: list[Any]) -> list[Any]:
        e = self.engines
        if modality == Modality.TEXT:
            if getattr(e, "text_alone", False):
                return [e.text.run_batch([p.text])[0] for p in parts]
            return e.text.run_batch([p.text for p in parts])
        if e.image is None or (modality in (Modality.VIDEO, Modality.AUDIO) and getattr(e, "audio", None) is None):
            return [RuntimeError(f"no {modality} engine loaded")] * len(parts)
        if modality == Modality.IMAGE:
            return e.image.run_batch([(p.data, p.mime) for p in parts])
        if modality == Modality.AUDIO:
            return e.audio.run_batch([(p.data, p.mime) for p in parts])
        return [self._video(p.data) for p in parts]

    def _video(self, data: bytes) -> Any:
        """Frames through the image encoder, pooled; the soundtrack through the audio encoder."""
        import numpy as np
        from PIL import Image


        v = self.engines.settings.video
        try:
            clip = decode_video(data, v.max_seconds, v.max_frames, v.fps)
            frames = self.engines.image.encode([Image.fromarray(f) for f in clip.frames])
            wav = extract_audio_wav(data, v.max_seconds) if clip.has_audio else None
            track = self.engines.audio.run_batch([(wav, "audio/wav")])[0] if wav else None
        except Exception as exc:
            return exc
        pooled = np.mean([f.embedding for f in frames], axis=0)
        return {"embedding": pooled / max(float(np.linalg.norm(pooled)), 1e-12),
                "frames": [[round(i / v.fps, 3), [[l, p] for l, p in f.top5[:3]]] for i, f in enumerate(frames)],
                "transcript": getattr(track, "transcript", None)}

    def _span(self, outcomes: list[Outcome], stage: str, started: float, finished: float) -> None:
        seen: set[int] = set()
        for o in outcomes:
            if id(o) not in seen:  # one span per request and engine call
                seen.add(id(o))
                # Queue time of a hop counts from where the request's previous hop ended,
                # so a request's spans add up to its e2e, as the pipeline's do.
                ready = o.arrived_at_ms + sum(s["queued_ms"] + s["service_ms"] for s in o.spans)
                o.spans.append({"stage": stage, "queued_ms": round(max(0.0, started - ready), 3),
                                "service_ms": round(finished - started, 3)})

    def _generate(self, batch: list[Outcome], grounding: dict[tuple[int, int], dict[str, Any]]) -> None:
        """The batch's sequences run on the generator stage's core (its scheduler, up to
        ``max_running`` at once) until every one has ended; the next batch waits for this
        one, as a monolith's does."""

        e = self.engines
        if e.lm is None:
            for o in batch:
                o.errors.append("generate: no language model loaded")
            return
        started = now_ms()
        first, last, count = {}, {}, {}
        for o in batch:
            parts = [{"modality": "text", "text": p.text} if p.modality == Modality.TEXT else grounding.get((id(o), i), {})
                     for i, p in enumerate(o.request.parts)]
            text = P.render_chatml(P.build_messages(prompt_parts(parts), P.PromptSettings()))
            ids = e.tokenizer.encode(text, add_special_tokens=False).ids
            params = SamplingParams(max_tokens=o.request.params.max_tokens, temperature=o.request.params.temperature,
                                    stop=o.request.params.stop)
            try:
                e.lm.submit(GenerationRequest(str(id(o)), tuple(ids), params, str(o.request.lane), time.monotonic()))
            except LMError as exc:
                o.errors.append(f"generate: {exc}")
        failed: dict[str, str] = {}
        while e.lm.has_work:
            updates = e.lm.step()
            now = now_ms()
            for u in updates:
                if u.finish_reason in ("error", "deadline_exceeded", "aborted"):
                    failed[u.key] = f"generate: {u.finish_reason}: {u.error}".rstrip(": ")
                if u.new_tokens:
                    first.setdefault(u.key, now)
                    last[u.key] = now
                    count[u.key] = count.get(u.key, 0) + 1
        for o in batch:
            sid = str(id(o))
            if sid in failed:
                o.errors.append(failed[sid])
            if sid in first:
                o.ttft_ms = first[sid] - o.arrived_at_ms
                o.tpot_ms = (last[sid] - first[sid]) / (count[sid] - 1) if count[sid] > 1 else None
        self._span(batch, "generate", started, now_ms())


def _grounding(modality: Modality, r: Any) -> dict[str, Any]:
    """What the LM is told about one encoded part (as the assembler forwards it)."""
    if isinstance(r, Exception):
        return {"modality": str(modality), "failed": True}
    if modality == Modality.IMAGE:
        return {"modality": "image", "labels": [[l, p] for l, p in r.top5]}
    if modality == Modality.AUDIO:
        return {"modality": "audio", "transcript": r.transcript}
    if modality == Modality.VIDEO:
        return {"modality": "video", "frames": r["frames"], "transcript": r["transcript"]}
    return {"modality": str(modality)}


class ModelServer:
    """The generic model server a new user compares against: one queue, one batcher and one
    engine thread per model (dynamic batching: up to ``max_batch_size`` items or
    ``max_wait_s``, padded to the longest), each model's requests served apart from the
    others', in this one process (no network ingress: its numbers are an upper bound on such
    a server here). It serves requests of one modality each (the text and capacity
    workloads); the same ``submit``/``run``/``close``/``outcomes`` as ``Monolith``.
    """

    def __init__(self, engines: Engines, limits: BatchLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.models = {m: Monolith(engines, limits, clock) for m in (Modality.TEXT, Modality.IMAGE)}

    def submit(self, request: Request, due_ms: float | None = None) -> Outcome:
        modalities = {p.modality for p in request.parts}
        if len(modalities) != 1 or next(iter(modalities)) not in self.models:
            raise ValueError("the model server serves requests of one modality, text or image")
        return self.models[next(iter(modalities))].submit(request, due_ms)

    def close(self) -> None:
        for m in self.models.values():
            m.close()

    async def run(self) -> None:
        await asyncio.gather(*(m.run() for m in self.models.values()))

    @property
    def outcomes(self) -> list[Outcome]:
        return [o for m in self.models.values() for o in m.outcomes]

    @property
    def batch_sizes(self) -> list[int]:
        return [n for m in self.models.values() for n in m.batch_sizes]
