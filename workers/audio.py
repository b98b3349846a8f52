"""Audio decoding, voice activity and the audio encoder: bytes in, embedding and transcript out.

Recipe, fixed by ``PREPROCESSING_VERSION``:

1. ``decode_audio``: WAV, FLAC, Ogg (Vorbis/Opus) or MP3, decoded by PyAV (FFmpeg bundled
   in its wheel), resampled to 16 kHz float32 and downmixed to mono by averaging channels. The duration is
   checked from the header when the container states one, and again while decoding, so an
   over-long clip is refused without decoding all of it.
2. ``speech_segments``: Silero VAD v6 (the ONNX copy bundled with faster-whisper, run on
   onnxruntime by faster-whisper's helper; the same network as ``silero-vad`` 6.x, so that
   package is not needed). Silence, tones and noise give no segments: such a clip gets an
   empty transcript and a zero embedding and never reaches the model.
3. ``pack_windows``: the speech segments, concatenated, are packed into Whisper's 30 s
   windows, cutting between segments where one fits and inside a segment only when a
   single segment is longer than 30 s.
4. Each window: 80-bin log-mel features (Whisper's recipe, faster-whisper's NumPy
   implementation), one encoder pass. The encoder output is used twice: mean-pooled over
   the frames that hold speech (20 ms each) and L2-normalized into the embedding, and
   decoded into the transcript (language detected from the first window unless fixed).

Backend: CTranslate2 (``workers.engines.ctranslate2.WhisperEngine``), not ONNX Runtime. The weights ship as
CTranslate2 files, so serving them as they are needs no conversion step and no torch at
build time; int8 on CPU measured 278 ms per 30 s window against 243 ms for an ONNX encoder
rebuilt from converted weights, and the ONNX path would still need a hand-written decoder
loop with a KV cache, where CTranslate2 brings greedy and beam search. The encoder output
is computed once and fed to both the pooling and the decoder.

One caller at a time (the worker calls it from one engine thread); the engine serializes
its own calls with a lock as well.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from schemas.errors import ErrorCode, WireError
from workers.isolation import decode_then_encode
from workers.text import EncoderOutputError

log = logging.getLogger(__name__)

# The reuse cache keys on this (with the model id and version): bump it whenever the
# samples or features fed to the model for a given input could change.
PREPROCESSING_VERSION = "audio-pyav-16k-meanmono-silero6-t50-sil500-pad200-pack30-whisper80mel-v1"

SAMPLE_RATE = 16_000
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's fixed 30 s input
MEL_FRAMES = 3000  # 10 ms hop
SAMPLES_PER_ENCODER_FRAME = 320  # the encoder halves the mel frames: 20 ms per output frame

# Container format names (PyAV / FFmpeg demuxers) that we decode. The bytes decide; the
# declared media type only refuses types we do not serve.
SUPPORTED_FORMATS = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg"}
_ACCEPTED_MIMES = frozenset(SUPPORTED_FORMATS.values()) | {
    "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/x-flac", "audio/opus",
    "audio/vorbis", "application/ogg", "audio/mp3", "audio/mpeg3", "audio/x-mpeg",
}  # fmt: skip

# VAD settings (part of the preprocessing version): a speech probability above 0.5 starts
# speech; gaps under 500 ms stay inside a segment; blips under 250 ms are dropped; 200 ms
# of context is kept either side so word edges are not clipped.
VAD_THRESHOLD = 0.5
VAD_MIN_SPEECH_MS = 250
VAD_MIN_SILENCE_MS = 500
VAD_SPEECH_PAD_MS = 200


def decode_audio(data: bytes, mime: str | None, max_seconds: float) -> np.ndarray:
    """Decode ``data`` (WAV, FLAC, Ogg Vorbis/Opus or MP3) into 16 kHz mono float32 samples.

    ``mime`` (parameters ignored) is a declaration: another type is refused, but the bytes
    decide how they are decoded. Clips longer than ``max_seconds`` are refused, from the
    header's duration when present, else once decoding passes the limit.

    Raises ``WireError``: ``PAYLOAD_TOO_LARGE`` for an over-long clip, ``UNSUPPORTED_MEDIA``
    for a refused type, bytes that are no supported audio, a corrupt file or no samples.
    """
    import av

    declared = (mime or "").split(";")[0].strip().lower()
    if declared and declared not in _ACCEPTED_MIMES:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"media type {declared!r} is not served; send {_supported()}")
    try:
        container = av.open(io.BytesIO(bytes(data)), mode="r", format=None)
    except MemoryError:
        raise
    except Exception:  # FFmpeg's probe failing surfaces as several av.error types
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"found {_describe(data)}; supported: {_supported()}") from None
    with container:
        name = container.format.name
        formats = set(name.split(","))
        if not formats & set(SUPPORTED_FORMATS) or not container.streams.audio:
            raise WireError(
                ErrorCode.UNSUPPORTED_MEDIA,
                f"found {container.format.long_name or container.format.name} without a supported audio stream; "
                f"supported: {_supported()}",
            )
        if container.duration is not None and container.duration / 1e6 > max_seconds + 0.05:
            raise _too_long(container.duration / 1e6, max_seconds)
        limit = int(max_seconds * SAMPLE_RATE)
        try:
            samples = decode_stream(container, limit)
        except WireError:
            raise
        except MemoryError:
            raise
        except Exception as e:  # damaged packets raise av.error.InvalidDataError and friends
            raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"{name} data is corrupt or truncated ({e})") from None
    if len(samples) > limit:
        raise _too_long(len(samples) / SAMPLE_RATE, max_seconds)
    if len(samples) == 0:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"{name} data holds no audio samples")
    return samples


def decode_stream(container: Any, limit: int) -> np.ndarray:
    """Samples of the first audio stream; stops once past ``limit`` samples (the caller refuses)."""
    import av

    stream = container.streams.audio[0]
    # Planar float at 16 kHz, channels kept: they are averaged below. FFmpeg's own mono
    # downmix scales each channel by 1/sqrt(2), which makes a centred stereo source 3 dB
    # louder than its mono original.
    resampler = av.AudioResampler(format="fltp", layout=None, rate=SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    total = 0

    def take(frames: Any) -> None:
        nonlocal total
        for frame in frames:
            planes = frame.to_ndarray()  # [channels, samples]
            array = planes[0] if len(planes) == 1 else planes.mean(axis=0)
            chunks.append(array)
            total += len(array)

    for frame in container.decode(stream):
        take(resampler.resample(frame))
        if total > limit:
            break
    else:
        take(resampler.resample(None))  # flush what the resampler holds back
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(chunks), dtype=np.float32)


def _too_long(seconds: float, max_seconds: float) -> WireError:
    return WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"audio of {seconds:.1f} s exceeds the limit of {max_seconds:g} s")


def _supported() -> str:
    return "WAV, FLAC, Ogg (Vorbis/Opus), MP3"


def _describe(data: bytes) -> str:
    """What ``data`` looks like, for an error message."""
    if not data:
        return "empty data"
    return f"{len(data)} bytes of unknown content starting {bytes(data[:8]).hex()}"


def speech_segments(samples: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) sample offsets of the speech in 16 kHz ``samples``, in order, padded
    and merged as the VAD settings above say; [] when there is no speech."""
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    options = VadOptions(
        threshold=VAD_THRESHOLD,
        min_speech_duration_ms=VAD_MIN_SPEECH_MS,
        min_silence_duration_ms=VAD_MIN_SILENCE_MS,
        speech_pad_ms=VAD_SPEECH_PAD_MS,
    )
    return [(int(s["start"]), int(s["end"])) for s in get_speech_timestamps(samples, options, SAMPLE_RATE)]


def normalized_speech(data: bytes, mime: str | None, max_seconds: float) -> bytes | None:
    """The speech the model hears (16 kHz mono samples inside the VAD's segments, as 16-bit
    PCM) as bytes: what the reuse cache keys a clip by, so the same words hit whatever the
    file's format, rate or surrounding silence. None when the clip does not decode."""
    try:
        samples = decode_audio(data, mime, max_seconds)
    except WireError:
        return None
    speech = [samples[start:end] for start, end in speech_segments(samples)]
    joined = np.concatenate(speech) if speech else np.zeros(0, np.float32)
    return (np.clip(joined, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def pack_windows(segments: Sequence[tuple[int, int]], window: int = WINDOW_SAMPLES) -> list[list[tuple[int, int]]]:
    """Group ``segments`` into windows of at most ``window`` samples in total, in order.

    A segment goes whole into the current window when it fits, else it starts a new one;
    a segment longer than ``window`` is cut into pieces of ``window`` samples.
    """
    windows: list[list[tuple[int, int]]] = []
    used = window  # forces a new window for the first segment
    for start, end in segments:
        while end - start > 0:
            length = end - start
            if used + length <= window:
                windows[-1].append((start, end))
                used += length
                break
            if length <= window:
                windows.append([(start, end)])
                used = length
                break
            windows.append([(start, start + window)])
            used = window
            start += window
    return windows


def pooled_embedding(encoded: Sequence[np.ndarray], speech_samples: Sequence[int]) -> np.ndarray:
    """Mean of the encoder frames that hold speech over all of a clip's windows, L2-normalized.

    ``encoded[i]`` is window i's encoder output [frames, dim]; ``speech_samples[i]`` how many
    of its samples are speech (they come first, the rest is padding).
    """
    total = None
    count = 0
    for frames, n in zip(encoded, speech_samples):
        used = min(len(frames), max(1, math.ceil(n / SAMPLES_PER_ENCODER_FRAME)))
        part = frames[:used].astype(np.float64).sum(axis=0)
        total = part if total is None else total + part
        count += used
    if total is None:
        raise ValueError("no windows to pool")
    mean = total / count
    norm = float(np.linalg.norm(mean))
    return (mean / norm if norm > 0 else mean).astype(np.float32)


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

    def warmup(self, n: int = 2) -> None:
        """Run ``n`` rounds on a synthetic voiced clip straight through the engine (the VAD
        would drop synthetic sound), so the runtime's buffers exist before the first request."""
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
