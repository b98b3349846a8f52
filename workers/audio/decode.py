"""Decoding: audio bytes in, 16 kHz mono float32 samples out (step 1 of ``workers.audio``).

WAV, FLAC, Ogg (Vorbis/Opus) or MP3, decoded by PyAV (FFmpeg bundled in its wheel),
resampled to ``SAMPLE_RATE`` and downmixed to mono by averaging channels. The container is
chosen from the bytes among those four and opened without FFmpeg's probing, and the codec,
channel count and rate come from an allow-list (``workers.media``), all before a sample is
decoded. The duration is checked from the header when the container states one, and again
while decoding, so an over-long clip is refused without decoding all of it. ``av`` is
imported inside the functions: importing this package loads no FFmpeg.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.errors import ErrorCode, WireError
from workers.media import AUDIO_CONTAINERS, check_audio_stream, open_container

SAMPLE_RATE = 16_000

# Container format names (PyAV / FFmpeg demuxers) that we decode. The bytes decide; the
# declared media type only refuses types we do not serve.
SUPPORTED_FORMATS = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg"}
_ACCEPTED_MIMES = frozenset(SUPPORTED_FORMATS.values()) | {
    "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/x-flac", "audio/opus",
    "audio/vorbis", "application/ogg", "audio/mp3", "audio/mpeg3", "audio/x-mpeg",
}  # fmt: skip


def decode_audio(data: bytes, mime: str | None, max_seconds: float) -> np.ndarray:
    """Decode ``data`` (WAV, FLAC, Ogg Vorbis/Opus or MP3) into 16 kHz mono float32 samples.

    ``mime`` (parameters ignored) is a declaration: another type is refused, but the bytes
    decide how they are decoded. Clips longer than ``max_seconds`` are refused, from the
    header's duration when present, else once decoding passes the limit.

    Raises ``WireError``: ``PAYLOAD_TOO_LARGE`` for an over-long clip, ``UNSUPPORTED_MEDIA``
    for a refused type, bytes that are no supported audio, a corrupt file or no samples.
    """
    declared = (mime or "").split(";")[0].strip().lower()
    if declared and declared not in _ACCEPTED_MIMES:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"media type {declared!r} is not served; send {_supported()}")
    if not data:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"found {_describe(data)}; supported: {_supported()}")
    container = open_container(data, AUDIO_CONTAINERS, "audio")
    with container:
        name = AUDIO_CONTAINERS.get(str(container.format.name).split(",")[0], "audio")
        if not container.streams.audio:
            raise WireError(ErrorCode.UNSUPPORTED_MEDIA,
                            f"found {name} without an audio stream; supported: {_supported()}")
        check_audio_stream(container.streams.audio[0])
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
    """Samples of the first audio stream; stops once past ``limit`` samples (the caller refuses).
    The stream must have passed ``workers.media.check_audio_stream``."""
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
    """What ``data`` looks like, for an error message (never its bytes: see ``workers.image``)."""
    if not data:
        return "empty data"
    return "unknown content"
