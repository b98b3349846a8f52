"""Audio decoding, voice activity and the audio encoder: bytes in, embedding and transcript out.

Recipe, fixed by ``PREPROCESSING_VERSION``, one module per step:

1. ``decode`` (``decode_audio``): WAV, FLAC, Ogg (Vorbis/Opus) or MP3, decoded by PyAV
   (FFmpeg bundled in its wheel), resampled to 16 kHz float32 and downmixed to mono by
   averaging channels. The duration is checked from the header when the container states
   one, and again while decoding, so an over-long clip is refused without decoding all of it.
2. ``vad`` (``speech_segments``): Silero VAD v6 (the ONNX copy bundled with faster-whisper,
   run on onnxruntime by faster-whisper's helper; the same network as ``silero-vad`` 6.x,
   so that package is not needed). Silence, tones and noise give no segments: such a clip
   gets an empty transcript and a zero embedding and never reaches the model.
3. ``windows`` (``pack_windows``): the speech segments, concatenated, are packed into
   Whisper's 30 s windows, cutting between segments where one fits and inside a segment
   only when a single segment is longer than 30 s.
4. ``encoder`` (``AudioEncoder``): each window: 80-bin log-mel features (Whisper's recipe,
   faster-whisper's NumPy implementation), one encoder pass. The encoder output is used
   twice: mean-pooled over the frames that hold speech (20 ms each) and L2-normalized into
   the embedding (``windows.pooled_embedding``), and decoded into the transcript (language
   detected from the first window unless fixed).

Backend: CTranslate2 (``workers.engines.ctranslate2.WhisperEngine``), not ONNX Runtime. The weights ship as
CTranslate2 files, so serving them as they are needs no conversion step and no torch at
build time; int8 on CPU measured 278 ms per 30 s window against 243 ms for an ONNX encoder
rebuilt from converted weights, and the ONNX path would still need a hand-written decoder
loop with a KV cache, where CTranslate2 brings greedy and beam search. The encoder output
is computed once and fed to both the pooling and the decoder.

Every public name of the steps is importable from this package.
"""

from workers.audio.decode import SAMPLE_RATE, SUPPORTED_FORMATS, decode_audio, decode_stream
from workers.audio.encoder import AudioEncoder, AudioOutput, EncoderOutputError  # the error it raises
from workers.audio.vad import (
    VAD_MIN_SILENCE_MS,
    VAD_MIN_SPEECH_MS,
    VAD_SPEECH_PAD_MS,
    VAD_THRESHOLD,
    normalized_speech,
    speech_segments,
)
from workers.audio.windows import MEL_FRAMES, SAMPLES_PER_ENCODER_FRAME, WINDOW_SAMPLES, pack_windows, pooled_embedding

# The reuse cache keys on this (with the model id and version): bump it whenever the
# samples or features fed to the model for a given input could change (any step above,
# the VAD settings in ``vad`` included).
PREPROCESSING_VERSION = "audio-pyav-16k-meanmono-silero6-t50-sil500-pad200-pack30-whisper80mel-v1"

__all__ = [
    "MEL_FRAMES", "PREPROCESSING_VERSION", "SAMPLES_PER_ENCODER_FRAME", "SAMPLE_RATE", "SUPPORTED_FORMATS",
    "VAD_MIN_SILENCE_MS", "VAD_MIN_SPEECH_MS", "VAD_SPEECH_PAD_MS", "VAD_THRESHOLD", "WINDOW_SAMPLES",
    "AudioEncoder", "AudioOutput", "EncoderOutputError", "decode_audio", "decode_stream",
    "normalized_speech", "pack_windows", "pooled_embedding", "speech_segments",
]
