"""The audio encoder: 16 kHz clips in, embedding and transcript out, with a
``workers.engines.ctranslate2.WhisperEngine`` doing the model's work (steps 2 to 4 of
``workers.audio``).

One caller at a time (the worker calls it from one engine thread); the engine serializes
its own calls with a lock as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from workers.audio.decode import SAMPLE_RATE, decode_audio
from workers.audio.vad import speech_segments
from workers.audio.windows import pack_windows, pooled_embedding
from workers.isolation import decode_then_encode
from workers.text import EncoderOutputError


@dataclass(frozen=True)
class AudioOutput:
    """What the encoder returns for one clip."""

    embedding: np.ndarray  # float32 [embedding_dim]; unit length, all zeros when there is no speech
    transcript: str  # "" when there is no speech
    speech_seconds: float  # speech found by the VAD (its padding included); 0.0 means none
    language: str | None = None  # Whisper language code of the transcript; None without speech


class AudioEncoder:
    """Embeds and transcribes clips with a ``WhisperEngine``.

    ``max_seconds`` bounds a clip's decoded duration. ``language`` fixes the transcript's
    language (a Whisper code such as "en"); None detects it per clip from its first window,
    at the cost of one decoder step. ``beam_size`` 1 is greedy decoding; 5 is Whisper's
    default and costs about 1.7x the decoding time. ``max_batch_windows`` bounds how many
    30 s windows go through the encoder in one call.
    """

    def __init__(
        self,
        engine: Any,  # workers.engines.ctranslate2.WhisperEngine
        max_seconds: float = 300.0,
        embedding_dim: int = 512,
        language: str | None = None,
        beam_size: int = 1,
        max_batch_windows: int = 8,
    ) -> None:
        self.engine = engine
        self.max_seconds = max_seconds
        self.embedding_dim = embedding_dim
        self.language = language
        self.beam_size = beam_size
        self.max_batch_windows = max_batch_windows

    def encode(self, clips: Sequence[np.ndarray]) -> list[AudioOutput]:
        """One ``AudioOutput`` per 16 kHz clip, in order; [] for [].

        Raises whatever the engine raises, and ``EncoderOutputError`` when the encoder's
        output does not have one row of the expected width per window.
        """
        windows: list[tuple[int, np.ndarray]] = []  # (clip index, speech samples)
        speech: list[float] = []
        for i, samples in enumerate(clips):
            segments = speech_segments(samples)
            speech.append(sum(e - s for s, e in segments) / SAMPLE_RATE)
            for window in pack_windows(segments):
                windows.append((i, np.concatenate([samples[s:e] for s, e in window])))
        frames: dict[int, list[np.ndarray]] = {}
        lengths: dict[int, list[int]] = {}
        texts: dict[int, list[str]] = {}
        languages: dict[int, str] = {}
        for start in range(0, len(windows), self.max_batch_windows):
            batch = windows[start : start + self.max_batch_windows]
            features = np.stack([self.engine.features(w) for _, w in batch])
            encoded = self.engine.encode(features)
            rows = np.asarray(encoded)
            if rows.ndim != 3 or rows.shape[0] != len(batch) or rows.shape[2] != self.embedding_dim:
                raise EncoderOutputError(
                    f"encoder returned {rows.shape} for {len(batch)} windows, expected ({len(batch)}, frames, {self.embedding_dim})"
                )
            # Later windows of a clip take the language of its first, so a clip has one.
            wanted = [self.language or languages.get(i) for i, _ in batch]
            decoded = self.engine.transcribe(encoded, wanted, self.beam_size)
            for (i, window), row, (text, lang) in zip(batch, rows, decoded):
                frames.setdefault(i, []).append(row)
                lengths.setdefault(i, []).append(len(window))
                texts.setdefault(i, []).append(text)
                languages.setdefault(i, lang)
        results = []
        for i in range(len(clips)):
            if i not in frames:
                results.append(AudioOutput(np.zeros(self.embedding_dim, np.float32), "", 0.0, None))
                continue
            text = " ".join(t for t in texts[i] if t)
            results.append(AudioOutput(pooled_embedding(frames[i], lengths[i]), text, round(speech[i], 3), languages[i]))
        return results

    def run_batch(self, datas: Sequence[tuple[bytes, str | None]]) -> list[AudioOutput | Exception]:
        """Like ``encode`` from (bytes, mime) pairs, but never raises: each slot holds an
        output or that item's error (``WireError`` for refused bytes).

        If the engine fails for the batch, each clip is retried alone, so one bad item does
        not fail the others.
        """
        def decode(item: tuple[bytes, str | None]) -> Any:
            data, mime = item
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"audio data must be bytes, got {type(data).__name__}")
            return decode_audio(bytes(data), mime, self.max_seconds)

        return decode_then_encode(datas, decode, self.encode)

    def warmup(self, n: int | None = None) -> None:
        """Load the VAD, then run ``n`` rounds on a synthetic voiced clip straight through the
        engine (the VAD would drop synthetic sound), so the runtime's buffers exist before the
        first request. ``None``: none on the CPU, where a first pass measured no slower than
        the next (0.99 s against 0.85-0.90 s for whisper-base int8 on 2 cores) and two rounds
        only cost a cold start 2 s; one on CUDA, where the first pass sets kernels up."""
        if n is None:  # the device it resolved to ("auto" picks CUDA only when CTranslate2 sees a GPU)
            n = 0 if str(self.engine.info.provider).startswith("cpu") else 1
        from faster_whisper.vad import get_vad_model

        get_vad_model()  # loads the VAD session once
        speech_segments(np.zeros(SAMPLE_RATE, np.float32))
        clip = _warmup_clip()
        for _ in range(n):
            encoded = self.engine.encode(self.engine.features(clip)[None])
            self.engine.transcribe(encoded, [self.language or "en"], self.beam_size)


def _warmup_clip() -> np.ndarray:
    """Two seconds of a vowel-like harmonic tone with a little noise."""
    t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
    tone = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 8))
    noise = np.random.default_rng(0).normal(0, 0.01, len(t))
    return (0.1 * tone + noise).astype(np.float32)
