"""The traffic a bench run offers: Poisson arrivals and the requests that ride on them.

Everything here is a function of the config's seed, rate and workload (``schedule``), so
the pipeline and the monolithic baseline get the same arrival times and the same bytes.
Media come from packages that ship them (scikit-image's sample photos; clips spoken by
espeak-ng and slideshows built by ``mmstream.samples``), and each medium is made bytes of
its own (a tag the decoders skip), so the content-keyed reuse cache answers only what the
config's ``repeat`` asks it to.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import random

from mmstream import samples
from mmstream.bench.config import BenchConfig
from schemas.request import Lane, Modality, Params, Part, Request, Task
from streams.client import new_id

WORDS = ("stream partition consumer latency model image token batch queue cache request encoder "
         "pipeline broker replica offset video audio text embedding vector kafka worker stage").split()

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three colours.",
    "Explain in two sentences what a Kafka consumer group is.",
    "Summarize this for a colleague: {context}",
    "Write a short haiku about {topic}.",
    "Which is larger, an elephant or a mouse? Answer in one sentence.",
)
# Request kinds of the mixed workload and their shares.
MIXED_KINDS = (("text", 0.45), ("text+image", 0.25), ("text+2images", 0.05), ("text+video", 0.2),
               ("text+audio", 0.05))
"""The design scenario: about half text-only, 30% with images, 20% with a video, a share of audio."""
SAMPLE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")
FLOOR_TEXT_WORDS = 13  # the median length of `text_request` (e^2.6 words)


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


def floor_text() -> str:
    """The text the compute floor is measured on: a median-length ``text_request`` text."""
    return _text(random.Random(0), FLOOR_TEXT_WORDS)
