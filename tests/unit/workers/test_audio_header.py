"""An audio clip's duration bound, read from its bytes before decoding: exact for PCM WAV,
the size at the lowest codec rate for anything else, never past the longest clip."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from workers.audio_header import MIN_BYTES_PER_S, HEAD_BYTES, pcm_wav_seconds, seconds_bound, windows


def wav(seconds: float, rate: int = 16_000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels), w.setsampwidth(width), w.setframerate(rate)
        w.writeframes(b"\x00" * int(seconds * rate) * channels * width)
    return buf.getvalue()


@pytest.mark.parametrize("rate,channels,width", [(16_000, 1, 2), (44_100, 2, 2), (22_050, 1, 1), (48_000, 2, 3)])
def test_a_pcm_wav_plays_what_its_size_at_its_byte_rate_says(rate, channels, width) -> None:
    data = wav(95.0, rate, channels, width)
    assert pcm_wav_seconds(data[:HEAD_BYTES], len(data)) == pytest.approx(95.0)
    assert windows(seconds_bound(data, len(data), 300.0)) == 4.0


def test_chunks_before_fmt_are_skipped_and_extensible_pcm_counts() -> None:
    data = wav(10.0)
    junk = b"JUNK" + struct.pack("<I", 27) + b"\x00" * 28  # odd size: padded to a word
    moved = data[:12] + junk + data[12:]
    assert pcm_wav_seconds(moved, len(moved)) == pytest.approx(10.0, abs=0.01)
    fmt = struct.pack("<HHIIHH", 0xFFFE, 1, 16_000, 32_000, 2, 16) + struct.pack("<HHI", 22, 16, 4)
    fmt += struct.pack("<H", 1) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    ext = b"RIFF" + struct.pack("<I", 0) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    assert pcm_wav_seconds(ext, len(ext) + 32_000 * 10) == pytest.approx(10.0 + (len(ext) - 44) / 32_000)


def test_compressed_or_inconsistent_headers_are_priced_by_size_at_the_lowest_rate() -> None:
    data = bytearray(wav(10.0))
    data[20:22] = struct.pack("<H", 3)  # float samples: not what the byte-rate rule knows
    assert pcm_wav_seconds(bytes(data), len(data)) is None
    data = bytearray(wav(10.0))
    data[28:32] = struct.pack("<I", 10_000_000)  # a byte rate that does not add up: claims 0.03 s
    assert pcm_wav_seconds(bytes(data), len(data)) is None
    assert seconds_bound(bytes(data), len(data), 300.0) == 300.0  # 320 KB at 750 B/s: past the longest
    assert seconds_bound(b"fLaC" + b"\x00" * 100, 15_000, 300.0) == 15_000 / MIN_BYTES_PER_S
    assert seconds_bound(b"", 0, 300.0) == 0.0 and windows(0.0) == 1.0


def test_windows_are_30_s_each_and_a_bound_is_never_past_the_longest_clip() -> None:
    assert [windows(s) for s in (0.5, 30.0, 30.5, 61.0, 300.0)] == [1.0, 1.0, 2.0, 3.0, 10.0]
    long = wav(400.0, 8_000)
    assert seconds_bound(long, len(long), 300.0) == 300.0
