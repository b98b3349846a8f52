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
from typing import Sequence

from mmstream import samples
from mmstream.bench.config import BenchConfig
from schemas.request import Lane, Modality, Params, Part, Request, Task
from streams.sdk.client import new_id

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


def scheduled_offsets(segments: tuple[tuple[float, float], ...], rng: random.Random) -> list[float]:
    """Poisson arrivals at each (rate, seconds) segment's rate in turn, as one list of offsets."""
    out, start = [], 0.0
    for rate, seconds in segments:
        out += [start + t for t in arrival_offsets(rate, seconds, rng)]
        start += seconds
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


MM_QUESTIONS = ("What is in this picture? Answer in one sentence.", "Describe this photo briefly.",
                "What animal or object does this image show?", "Name the main thing in this picture.")


def chat_mm_request(rng: random.Random, lane: str, max_tokens: int = 32) -> Request:
    """A generate request over a photo: a question beside one of the sample photos, made
    bytes of its own (a tag in the JPEG comment) so the reuse cache does not answer it; the
    image pool labels it and the generator answers from the labels (the cascade)."""
    data, mime = rng.choice(sample_images())
    tagged = _with_comment(data, rng.getrandbits(64)) if mime == "image/jpeg" else data
    return Request(id=new_id(), task=Task.GENERATE, lane=Lane(lane), params=Params(max_tokens=max_tokens),
                   deadline_ms=120_000, parts=(Part(Modality.TEXT, text=rng.choice(MM_QUESTIONS)),
                                               Part(Modality.IMAGE, data=tagged, mime=mime)))


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


# The capacity mix (what a generic model server holds ~60 req/s of on a 2-core box): 60% text
# requests, 40% one JPEG photo. Texts: half one sentence (~15 tokens), 35% four sentences
# (~60), 15% fifteen (~250); photos with a longer side of 256, 512 or 1024 px.
CAPACITY_TEXT_SHARE = 0.6
CAPACITY_SENTENCES = ((1, 0.5), (4, 0.35), (15, 0.15))
CAPACITY_SIDES = (256, 512, 1024)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 13))).capitalize() + "."


def run_tenants(requests: Sequence[Request], shared: str, salt: str) -> list[Request]:
    """The tenants one run sends as: requests without one share ``shared``; a workload's own
    per-request tenants get the run's ``salt``, so the next run of the same seed (a sweep's
    next rate) is not answered from the reuse cache the previous one filled."""
    return [dataclasses.replace(r, tenant=shared) if r.tenant == "default"
            else dataclasses.replace(r, tenant=f"{r.tenant}-{salt}") for r in requests]


def capacity_request(rng: random.Random, lane: str) -> Request:
    """One request of the capacity mix, deterministic from ``rng``, as a tenant of its own: the
    reuse caches key on the tenant, so no request is answered from another's work (what the
    capacity numbers measure is compute and hops, not reuse)."""
    if rng.random() < CAPACITY_TEXT_SHARE:
        x, acc, n = rng.random(), 0.0, CAPACITY_SENTENCES[-1][0]
        for count, share in CAPACITY_SENTENCES:
            acc += share
            if x < acc:
                n = count
                break
        part = Part(Modality.TEXT, text=" ".join(_sentence(rng) for _ in range(n)))
    else:
        part = _sized_photo(rng)
    return Request(id=new_id(), parts=(part,), lane=Lane(lane), tenant=f"capacity-{rng.getrandbits(48):012x}")


def images_request(rng: random.Random, lane: str) -> Request:
    """The capacity mix's photos alone (one of 256-1024 px, bytes of its own, a tenant of its
    own): a load on one single-threaded stage, the image encoder, that leaves the box's other
    cores free, which is the load a second replica of that stage is for."""
    part = _sized_photo(rng)
    return Request(id=new_id(), parts=(part,), lane=Lane(lane), tenant=f"capacity-{rng.getrandbits(48):012x}")


def audio_request(rng: random.Random, lane: str) -> Request:
    """A spoken clip of 5 to 15 words alone (espeak-ng, as the mixed workload's), a tenant of
    its own: a load on the audio encoder, a pool that starts at zero and is one engine thread
    per replica, so a step of it is what the scaler's wake, growth and idle stop are for."""
    clip = samples.speech(_text(rng, rng.randint(5, 15)))
    if clip is None:
        raise RuntimeError("the audio workload needs espeak-ng (apt-get install espeak-ng)")
    part = Part(Modality.AUDIO, data=clip, mime="audio/wav")
    return Request(id=new_id(), parts=(part,), lane=Lane(lane), tenant=f"capacity-{rng.getrandbits(48):012x}")


def _sized_photo(rng: random.Random) -> Part:
    data, mime = sized_photos()[rng.randrange(len(sized_photos()))]
    return Part(Modality.IMAGE, data=_with_comment(data, rng.getrandbits(64)), mime=mime)


@functools.lru_cache(maxsize=1)
def sized_photos() -> tuple[tuple[bytes, str], ...]:
    """The sample photos as JPEGs (quality 90) with a longer side of each ``CAPACITY_SIDES``."""
    from PIL import Image

    out = []
    for data, _ in sample_images():
        image = Image.open(io.BytesIO(data)).convert("RGB")
        for side in CAPACITY_SIDES:
            scale = side / max(image.size)
            resized = image.resize((max(1, round(image.size[0] * scale)), max(1, round(image.size[1] * scale))),
                                   Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            resized.save(buf, "JPEG", quality=90)
            out.append((buf.getvalue(), "image/jpeg"))
    return tuple(out)


def request_kind(request: Request) -> str:
    """``text``, ``text+image`` or ``text+2images`` (any other mix: its modalities joined;
    a lone photo is ``image``)."""
    if len(request.parts) == 1 and request.parts[0].modality == Modality.IMAGE:
        return "image"
    n_images = sum(p.modality == Modality.IMAGE for p in request.parts)
    if all(p.modality in (Modality.TEXT, Modality.IMAGE) for p in request.parts) and len(request.parts) == n_images + 1:
        return ("text", "text+image", "text+2images")[n_images] if n_images < 3 else f"text+{n_images}images"
    return "+".join(str(p.modality) for p in request.parts)


def schedule(cfg: BenchConfig, rate: float) -> tuple[list[float], list[Request]]:
    """The arrival offsets and requests of one run: a function of (seed, rate, workload) only."""
    rng = random.Random(f"{cfg.seed}:{rate}")
    offsets = scheduled_offsets(cfg.rate_schedule, rng) if cfg.rate_schedule else arrival_offsets(rate, cfg.duration_s, rng)
    if cfg.workload in ("chat", "chat-mm"):
        make_chat = chat_request if cfg.workload == "chat" else chat_mm_request
        requests = [make_chat(rng, cfg.lane, cfg.chat_max_tokens) for _ in offsets]
    else:
        make = {"text": text_request, "mixed": mixed_request, "capacity": capacity_request,
                "images": images_request, "audio": audio_request}[cfg.workload]
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
