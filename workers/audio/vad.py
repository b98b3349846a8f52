"""Voice activity: where the speech is in a clip (step 2 of ``workers.audio``).

Silero VAD v6 (the ONNX copy bundled with faster-whisper, run on onnxruntime by
faster-whisper's helper; the same network as ``silero-vad`` 6.x, so that package is not
needed). Silence, tones and noise give no segments: such a clip gets an empty transcript
and a zero embedding and never reaches the model. ``normalized_speech`` is the speech
itself as bytes: what the reuse cache keys a clip by.
"""

from __future__ import annotations

import numpy as np

from schemas.errors import WireError
from workers.audio.decode import SAMPLE_RATE, decode_audio

# VAD settings (part of the preprocessing version): a speech probability above 0.5 starts
# speech; gaps under 500 ms stay inside a segment; blips under 250 ms are dropped; 200 ms
# of context is kept either side so word edges are not clipped.
VAD_THRESHOLD = 0.5
VAD_MIN_SPEECH_MS = 250
VAD_MIN_SILENCE_MS = 500
VAD_SPEECH_PAD_MS = 200


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
