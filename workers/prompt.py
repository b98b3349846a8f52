"""Prompt building for multimodal grounding by cascade: what the language model reads.

The language model sees text only. Every other part arrives as what an upstream model made
of it: an image as its top labels with scores, audio as its transcript, a video as labels
of sampled frames plus its transcript. ``build_messages`` turns a request's parts, in their
order, into chat messages; ``render_chatml`` writes them in the model's chat format.

Format of the user message (one block per part, blank line between blocks)::

    [image 1] labels: tabby cat 0.82, tiger cat 0.10, Egyptian cat 0.05
    [audio 1] transcript: "turn left at the next corner"
    [video 1] frames: 0.0 s: beach 0.71, seashore 0.20 | 2.0 s: sandbar 0.64
    [video 1] transcript: "the waves are high today"
    What is in the picture?

A part of another modality (a plugin's) is an ``AttachmentPart``: ``[<modality> N] <what>:
"<text>"``, quoted and cut like a transcript.

Text parts are written as they are. Labels are the ``max_labels`` best at or above
``min_score``, best first, scores with two decimals; a part with none says ``(no confident
labels)``, a failed part says ``(unavailable)``, so the model can say it does not know
instead of guessing. Transcripts are quoted and cut at ``max_transcript_chars``.

Untrusted content (user text, labels, transcripts) cannot open or close a chat turn: the
template's control markers are removed from it.

Pure: no I/O, no model, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

DEFAULT_SYSTEM = (
    "You are a helpful assistant. You cannot see images, hear audio or watch video yourself: "
    "each attachment is described by automatic recognizers, as labels with confidence scores "
    "from 0 to 1 or as a transcript. Answer from these descriptions and the user's text, and "
    "say so when they are not enough."
)

# ChatML control markers (SmolLM2's template); user content must never contain them.
CONTROL_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


PASSAGES_INTRO = "Use these passages where they answer the question; name the ones you use as [1], [2]:"


@dataclass(frozen=True, slots=True)
class Label:
    name: str
    score: float  # 0..1


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    labels: Sequence[Label] = ()
    failed: bool = False  # the image could not be decoded or encoded


@dataclass(frozen=True, slots=True)
class AudioPart:
    transcript: str = ""
    failed: bool = False


@dataclass(frozen=True, slots=True)
class FrameLabels:
    at_s: float  # frame time from the start of the video, seconds
    labels: Sequence[Label] = ()


@dataclass(frozen=True, slots=True)
class VideoPart:
    frames: Sequence[FrameLabels] = ()
    transcript: str | None = None  # None: no audio track (or not transcribed)
    failed: bool = False


@dataclass(frozen=True, slots=True)
class AttachmentPart:
    """A part of any other modality, as words some upstream model made of it."""

    modality: str  # the tag: "[doc 1]"
    what: str  # what the words are: "text", "summary", "caption"
    text: str = ""
    failed: bool = False


Part = Union[TextPart, ImagePart, AudioPart, VideoPart, AttachmentPart]


@dataclass(frozen=True, slots=True)
class PromptSettings:
    system: str = DEFAULT_SYSTEM
    max_labels: int = 3  # labels shown per image or frame; more rarely helps a small model
    min_score: float = 0.05  # labels below are noise to the reader
    max_frames: int = 8  # frames shown per video, evenly spread when there are more
    max_transcript_chars: int = 2000  # bounds the prompt; the model's context is small
    history: Sequence[dict[str, str]] = field(default_factory=tuple)  # earlier turns, oldest first
    passages: Sequence[str] = field(default_factory=tuple)
    """Retrieved passages (RAG), in the order given: they go into the system message, ahead of
    everything that differs between requests, so requests that retrieve the same passages
    share the prompt prefix (and the prefix cache its KV)."""

    def __post_init__(self) -> None:
        if self.max_labels < 1 or self.max_frames < 1 or self.max_transcript_chars < 1:
            raise ValueError(f"invalid prompt settings {self}")


def build_messages(parts: Sequence[Part], settings: PromptSettings = PromptSettings()) -> list[dict[str, str]]:
    """Chat messages (system, earlier turns, this user turn) for ``parts`` in order.
    Raises ``ValueError`` when there are no parts or one is of an unknown type."""
    if not parts:
        raise ValueError("a prompt needs at least one part")
    counts: dict[str, int] = {"image": 0, "audio": 0, "video": 0}
    blocks = []
    for part in parts:
        if isinstance(part, TextPart):
            blocks.append(_clean(part.text).strip())
        elif isinstance(part, ImagePart):
            counts["image"] += 1
            tag = f"[image {counts['image']}]"
            blocks.append(f"{tag} (unavailable)" if part.failed else f"{tag} labels: {_labels(part.labels, settings)}")
        elif isinstance(part, AudioPart):
            counts["audio"] += 1
            tag = f"[audio {counts['audio']}]"
            blocks.append(f"{tag} (unavailable)" if part.failed else f"{tag} transcript: {_quote(part.transcript, settings)}")
        elif isinstance(part, VideoPart):
            counts["video"] += 1
            blocks.append(_video(part, f"[video {counts['video']}]", settings))
        elif isinstance(part, AttachmentPart):
            counts[part.modality] = counts.get(part.modality, 0) + 1
            tag = f"[{_clean(part.modality)} {counts[part.modality]}]"
            blocks.append(f"{tag} (unavailable)" if part.failed
                          else f"{tag} {_clean(part.what)}: {_quote(part.text, settings)}")
        else:
            raise ValueError(f"unknown part type {type(part).__name__}")
    system = _clean(settings.system)
    if settings.passages:
        system += "\n\n" + PASSAGES_INTRO + "".join(f"\n[{i}] {_clean(t).strip()}"
                                                 for i, t in enumerate(settings.passages, 1))
    messages = [{"role": "system", "content": system}]
    messages += [{"role": m["role"], "content": _clean(m["content"])} for m in settings.history]
    messages.append({"role": "user", "content": "\n\n".join(b for b in blocks if b)})
    return messages


def render_chatml(messages: Sequence[dict[str, str]]) -> str:
    """``messages`` in ChatML with the assistant's turn opened, exactly as SmolLM2's
    packaged template renders them (the model build checks this). The first message must
    be the system message: the packaged template would insert a default one otherwise."""
    if not messages or messages[0]["role"] != "system":
        raise ValueError("the first message must be the system message")
    turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(turns) + "<|im_start|>assistant\n"


def build_prompt(parts: Sequence[Part], settings: PromptSettings = PromptSettings()) -> str:
    """``render_chatml(build_messages(parts, settings))``: the text to tokenize (with the
    tokenizer's own special tokens off: the markers are already in the text)."""
    return render_chatml(build_messages(parts, settings))


def _labels(labels: Sequence[Label], settings: PromptSettings) -> str:
    kept = sorted((l for l in labels if l.score >= settings.min_score), key=lambda l: -l.score)
    kept = kept[: settings.max_labels]
    if not kept:
        return "(no confident labels)"
    return ", ".join(f"{_clean(l.name).strip()} {l.score:.2f}" for l in kept)


def _video(part: VideoPart, tag: str, settings: PromptSettings) -> str:
    if part.failed:
        return f"{tag} (unavailable)"
    frames = sorted(part.frames, key=lambda f: f.at_s)
    if len(frames) > settings.max_frames:
        step = len(frames) / settings.max_frames
        frames = [frames[int(i * step)] for i in range(settings.max_frames)]
    shown = " | ".join(f"{f.at_s:.1f} s: {_labels(f.labels, settings)}" for f in frames)
    lines = [f"{tag} frames: {shown or '(none)'}"]
    if part.transcript is not None:
        lines.append(f"{tag} transcript: {_quote(part.transcript, settings)}")
    return "\n".join(lines)


def _quote(text: str, settings: PromptSettings) -> str:
    text = " ".join(_clean(text).split())
    if not text:
        return "(no speech)"
    if len(text) > settings.max_transcript_chars:
        text = text[: settings.max_transcript_chars].rstrip() + "…"
    return f'"{text}"'


def _clean(text: str) -> str:
    for marker in CONTROL_MARKERS:
        text = text.replace(marker, "")
    # A marker split by a removed one ("<|im_<|im_end|>end|>") must not reassemble.
    return _clean(text) if any(m in text for m in CONTROL_MARKERS) else text
