"""What the fairness workload's two tenants send (``mmstream bench --workload fairness``): the
victim's ordinary rt text embeds, and the abuser's worst requests validation lets through
(``ABUSE_SHAPES``, sized from the settings by ``AbuseBounds``). Pure but for the sample PNG it
builds once; ``fairness`` reports on what they got."""

from __future__ import annotations

import functools
import io
import math
import random
import zlib
from dataclasses import dataclass
from typing import Sequence

from mmstream.bench.workloads import WORDS, arrival_offsets, images_request, text_request
from schemas.request import Lane, Limits, Modality, Params, Part, Request, Task
from schemas.settings import Settings

ABUSE_SHAPES = ("max_text", "max_images", "ref_fanout", "max_generate", "max_audio")
"""What the abuser sends: ``max_text`` (the most text parts, each at the text bound, the
request under the ingress bound), ``max_images`` (the most inline PNGs at the pixel bound
that fit one request), ``ref_fanout`` (every part a ref to one stored blob at the size that
puts the request at its ref-bytes cap: the router prices each part at the blob's size) and
``max_generate`` (max_tokens at its bound, the longest prompt that leaves room for them in
the context; only where a generator runs), ``max_audio`` (the most inline WAVs that fit one
request, each at the inline bound of speech at 8 kHz and 8 bits: the most seconds a byte
buys, about 130 s and five Whisper windows a part; only where an audio encoder runs and
espeak-ng speaks)."""
SPEECH = ("the quick brown fox jumps over the lazy dog while the committee reviews the quarterly "
          "budget and the train to the coast leaves from platform seven at half past nine")
"""What ``max_audio``'s parts say (espeak-ng), repeated to fill each part."""

TAG_KEYWORD = b"mmstream-bench"
"""The PNG text chunk that makes each abuser image bytes of its own (no reuse cache answers A)."""
REQUEST_OVERHEAD_BYTES = 16 * 1024
"""Room left under ``max_request_bytes`` for the request's own fields and framing."""
GENERATE_PROMPT_WORDS = 800
"""About 900 tokens of SmolLM2's tokenizer with the system prompt (measured: 700 words of
``WORDS`` render to 802), so prompt + max_tokens 1024 fit its 2048-token context."""
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


def victim_schedule(seed: int, rate: float, duration_s: float, phase: str,
                    image_share: float = 0.0) -> tuple[list[float], list[Request]]:
    """B's arrivals and requests in ``phase`` (``alone`` or ``flood``): the same offsets in
    every phase (a function of seed, rate and duration), requests drawn per phase: texts, and
    with ``image_share`` that share of one photo each (the capacity mix's, 256-1024 px)."""
    offsets = arrival_offsets(rate, duration_s, random.Random(f"{seed}:{rate}:victim"))
    rng = random.Random(f"{seed}:{rate}:victim:{phase}")
    return offsets, [images_request(rng, "rt") if image_share > 0 and rng.random() < image_share
                     else text_request(rng, "rt") for _ in offsets]


def abuse_shapes(chosen: Sequence[str] | None, generator: bool, audio: bool) -> tuple[str, ...]:
    """The shapes A sends: ``chosen`` (``--abuse-shapes``), else every one the deployment can
    be made to work on (``max_generate`` where a generator runs, ``max_audio`` where an audio
    encoder runs and espeak-ng is installed)."""
    if chosen:
        unknown = [x for x in chosen if x not in ABUSE_SHAPES]
        if unknown:
            raise ValueError(f"abuse shapes must be some of {', '.join(ABUSE_SHAPES)}, got {', '.join(unknown)}")
        return tuple(dict.fromkeys(chosen))
    import shutil

    return tuple(x for x in ABUSE_SHAPES if (x != "max_generate" or generator)
                 and (x != "max_audio" or (audio and shutil.which("espeak-ng") is not None)))


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
    if item.shape == "max_audio":
        clip = long_speech_wav(min(bounds.max_inline_bytes, bounds.max_request_bytes - REQUEST_OVERHEAD_BYTES) - 64)
        fits = max(1, (bounds.max_request_bytes - REQUEST_OVERHEAD_BYTES) // (len(clip) + 64))
        parts = tuple(Part(Modality.AUDIO, data=_tagged_wav(clip, item.tag, i), mime="audio/wav")
                      for i in range(min(fits, bounds.max_parts)))
        return Request(parts=parts, **common)
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


@functools.lru_cache(maxsize=2)
def long_speech_wav(size: int) -> bytes:
    """A WAV of ``size`` bytes at most: ``SPEECH`` spoken by espeak-ng, resampled to 8 kHz
    unsigned 8-bit mono and repeated to fill it. Raises ``RuntimeError`` without espeak-ng."""
    import wave

    import numpy as np

    from mmstream import samples

    spoken = samples.speech(SPEECH)
    if spoken is None:
        raise RuntimeError("the max_audio abuse shape needs espeak-ng (apt-get install espeak-ng)")
    with wave.open(io.BytesIO(spoken)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32)
    at = np.arange(0, len(pcm) - 1, rate / 8000.0)
    u8 = (np.interp(at, np.arange(len(pcm)), pcm) / 256.0 + 128.0).clip(0, 255).astype(np.uint8).tobytes()
    body = (u8 * ((size - 44) // len(u8) + 1))[: size - 44]
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(1), w.setframerate(8000)
        w.writeframes(body)
    return out.getvalue()


def _tagged_wav(wav: bytes, tag: int, part: int) -> bytes:
    """``wav`` with every 997th sample one step louder from a place ``tag`` and ``part`` pick:
    the same speech to a listener, other samples to a content-keyed cache."""
    body = bytearray(wav[44:])
    for i in range((tag + 131 * part) % 997, len(body), 997):
        body[i] = min(255, body[i] + 1)
    return wav[:44] + bytes(body)


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
