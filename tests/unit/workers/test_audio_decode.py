"""Audio decoding: formats, resampling to 16 kHz mono, the duration guard, refused bytes."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

av = pytest.importorskip("av")

from schemas.errors import ErrorCode, WireError  # noqa: E402
from workers.audio import SAMPLE_RATE, decode_audio  # noqa: E402
from workers.audio_header import HEAD_BYTES, SLACK_S, declared_seconds, seconds_bound  # noqa: E402


def tone(seconds: float, rate: int, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.5 * np.sin(2 * np.pi * freq * t)
    return np.repeat(mono[:, None], channels, axis=1)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM WAV written with the standard library (samples [n, channels] in [-1, 1])."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def encoded(fmt: str, codec: str, seconds: float = 2.0, rate: int = 48_000) -> bytes:
    """A mono tone encoded by PyAV's bundled FFmpeg."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        samples = tone(seconds, rate)[:, 0].astype(np.float32)
        fmt_name = stream.codec_context.codec.audio_formats[0].name
        frame_size = stream.codec_context.frame_size or 1024
        for start in range(0, len(samples), frame_size):
            chunk = samples[start : start + frame_size]
            if fmt_name.startswith("s16"):
                data = (chunk * 32767).astype(np.int16)[None]
            elif fmt_name.startswith("s32"):
                data = (chunk * 2147483647).astype(np.int32)[None]
            else:
                data = chunk[None]
            frame = av.AudioFrame.from_ndarray(data, format=fmt_name, layout="mono")
            frame.rate = rate
            frame.pts = start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def test_wav_made_with_numpy_decodes_to_16k_mono_of_the_right_length() -> None:
    samples = decode_audio(wav_bytes(tone(1.5, 44_100, channels=2), 44_100), "audio/wav", max_seconds=10)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 1.5 * SAMPLE_RATE) <= 32
    assert 0.4 < float(np.abs(samples).max()) <= 0.55  # channels are averaged: the level is kept


def test_wav_at_16k_is_passed_through_sample_for_sample() -> None:
    samples = decode_audio(wav_bytes(tone(1.0, SAMPLE_RATE), SAMPLE_RATE), None, max_seconds=10)
    assert len(samples) == SAMPLE_RATE
    np.testing.assert_allclose(samples, tone(1.0, SAMPLE_RATE)[:, 0], atol=1e-3)


@pytest.mark.parametrize(
    "fmt,codec,mime",
    [("flac", "flac", "audio/flac"), ("ogg", "libopus", "audio/ogg"), ("mp3", "libmp3lame", "audio/mpeg")],
)
def test_compressed_formats_decode(fmt: str, codec: str, mime: str) -> None:
    samples = decode_audio(encoded(fmt, codec), mime, max_seconds=10)
    # Encoders add priming and padding: allow 100 ms either way.
    assert abs(len(samples) - 2 * SAMPLE_RATE) < 0.1 * SAMPLE_RATE
    assert float(np.abs(samples).max()) > 0.3


@pytest.mark.parametrize("fmt,codec", [("flac", "flac"), ("mp3", "libmp3lame")])
@pytest.mark.parametrize("seconds,rate", [(2.0, 48_000), (7.5, 16_000), (40.0, 22_050)])
def test_flac_and_mp3_are_priced_at_what_they_play_and_decode_within_it(fmt, codec, seconds, rate) -> None:
    """What FFmpeg writes (FLAC's STREAMINFO, the mp3 muxer's Xing/Info tag) bounds the clip
    from above, within an MP3's frame of encoder padding, and the decoder held to that bound
    (as the audio worker holds it) decodes the whole clip."""
    data = encoded(fmt, codec, seconds, rate)
    declared = declared_seconds(data[:HEAD_BYTES], len(data))
    assert declared is not None and seconds <= declared <= seconds + 0.1
    bound = seconds_bound(data[:HEAD_BYTES], len(data), 300.0) + SLACK_S
    assert abs(len(decode_audio(data, None, bound)) - seconds * SAMPLE_RATE) < 0.1 * SAMPLE_RATE


@pytest.mark.parametrize("fmt,codec", [("flac", "flac"), ("mp3", "libmp3lame")])
def test_a_header_that_declares_less_than_it_holds_is_refused_at_its_own_bound(fmt, codec) -> None:
    """A clip priced at a tenth of what it holds costs its sender only: the worker decodes no
    further than the declared bound and refuses it."""
    data = bytearray(encoded(fmt, codec, 20.0, 16_000))
    if fmt == "flac":
        packed = int.from_bytes(data[18:26], "big")
        packed = (packed & ~((1 << 36) - 1)) | (2 * 16_000)  # 2 s of samples
        data[18:26] = packed.to_bytes(8, "big")
    else:
        at = data.index(b"Info") if b"Info" in data[:HEAD_BYTES] else data.index(b"Xing")
        data[at + 8:at + 12] = (2 * 16_000 // 576).to_bytes(4, "big")  # 2 s of MPEG-2 frames
    bound = seconds_bound(bytes(data[:HEAD_BYTES]), len(data), 300.0)
    assert bound < 2.5
    with pytest.raises(WireError) as e:
        decode_audio(bytes(data), None, bound + SLACK_S)
    assert e.value.code == ErrorCode.PAYLOAD_TOO_LARGE


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_are_unsupported_media(seed: int) -> None:
    data = np.random.default_rng(seed).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    with pytest.raises(WireError) as e:
        decode_audio(data, None, max_seconds=10)
    assert e.value.code == ErrorCode.UNSUPPORTED_MEDIA


@pytest.mark.parametrize("data", [b"", b"RIFF\x00\x00\x00\x00WAVEfmt ", b"\x89PNG\r\n\x1a\n" + bytes(100)])
def test_empty_truncated_and_non_audio_are_unsupported_media(data: bytes) -> None:
    with pytest.raises(WireError) as e:
        decode_audio(data, None, max_seconds=10)
    assert e.value.code == ErrorCode.UNSUPPORTED_MEDIA


def test_declared_type_we_do_not_serve_is_refused() -> None:
    with pytest.raises(WireError) as e:
        decode_audio(wav_bytes(tone(0.5, SAMPLE_RATE), SAMPLE_RATE), "video/mp4", max_seconds=10)
    assert e.value.code == ErrorCode.UNSUPPORTED_MEDIA


def test_over_long_wav_is_payload_too_large() -> None:
    with pytest.raises(WireError) as e:
        decode_audio(wav_bytes(tone(3.0, SAMPLE_RATE), SAMPLE_RATE), "audio/wav", max_seconds=2)
    assert e.value.code == ErrorCode.PAYLOAD_TOO_LARGE


def test_over_long_mp3_is_payload_too_large() -> None:
    with pytest.raises(WireError) as e:
        decode_audio(encoded("mp3", "libmp3lame", seconds=3.0), None, max_seconds=1)
    assert e.value.code == ErrorCode.PAYLOAD_TOO_LARGE


def test_streamed_wav_with_a_placeholder_size_is_measured_by_its_data() -> None:
    """Writers to a pipe (espeak-ng --stdout, ffmpeg) cannot seek back to fill in sizes."""
    data = bytearray(wav_bytes(tone(1.0, SAMPLE_RATE), SAMPLE_RATE))
    data[4:8] = data[40:44] = (0x7FFFF000).to_bytes(4, "little")
    assert len(decode_audio(bytes(data), "audio/wav", max_seconds=2)) == SAMPLE_RATE


def test_clip_at_the_limit_is_accepted() -> None:
    samples = decode_audio(wav_bytes(tone(2.0, SAMPLE_RATE), SAMPLE_RATE), "audio/wav", max_seconds=2)
    assert len(samples) == 2 * SAMPLE_RATE


def test_the_same_speech_normalizes_the_same_in_another_container():
    import io
    import shutil
    import subprocess
    import tempfile
    import wave
    from pathlib import Path

    import av
    import numpy as np

    from workers.audio import normalized_speech

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng makes the speech; make test installs it")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.wav"
        subprocess.run(["espeak-ng", "-w", str(out), "hello there, general kenobi"], check=True)
        wav = out.read_bytes()
    with wave.open(io.BytesIO(wav)) as w:
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    flac = io.BytesIO()
    with av.open(flac, mode="w", format="flac") as container:  # lossless: the same samples
        stream = container.add_stream("flac", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(pcm[None, :].copy(), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    a = normalized_speech(wav, "audio/wav", 60)
    b = normalized_speech(flac.getvalue(), "audio/flac", 60)
    assert a and a == b
    assert normalized_speech(b"junk", "audio/wav", 60) is None
