"""An audio clip's duration bound, read from its bytes before decoding: exact for PCM WAV, FLAC
and a tagged MP3, the size at the lowest codec rate for anything else, never past the longest
clip. (Real FLAC and MP3 files, and what the decoder does with a header that lies, are in
test_audio_decode.py.)"""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from workers.audio_header import (MIN_BYTES_PER_S, HEAD_BYTES, declared_seconds, flac_seconds, mp3_seconds,
                                  pcm_wav_seconds, seconds_bound, windows)


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


def flac_head(rate: int, samples: int) -> bytes:
    packed = (rate << 44) | (0 << 41) | (15 << 36) | samples  # mono, 16 bits
    info = struct.pack(">HH", 4096, 4096) + b"\x00" * 6 + packed.to_bytes(8, "big") + b"\x00" * 16
    return b"fLaC" + b"\x80\x00\x00\x22" + info  # last metadata block, STREAMINFO, 34 bytes


def id3(size: int) -> bytes:
    return b"ID3\x04\x00\x00" + bytes([(size >> 21) & 0x7F, (size >> 14) & 0x7F, (size >> 7) & 0x7F, size & 0x7F]) \
        + b"\x00" * size


def mp3_head(tag: bytes, frames: int, mono: bool = False, flags: int = 1) -> bytes:
    """An MPEG-1 Layer III frame at 44.1 kHz, 128 kbit/s, whose body starts with ``tag``."""
    header = bytes([0xFF, 0xFB, 0x90, 0xC4 if mono else 0x44])
    body = b"\x00" * (17 if mono else 32) + tag + struct.pack(">II", flags, frames)
    return header + body + b"\x00" * (417 - 4 - len(body))


def test_flac_plays_what_its_streaminfo_says_and_an_unknown_total_falls_back_to_size() -> None:
    assert flac_seconds(flac_head(44_100, 441_000)) == pytest.approx(10.0)
    assert seconds_bound(flac_head(44_100, 441_000) + b"\x00" * 600_000, 600_042, 300.0) == pytest.approx(10.0)
    assert flac_seconds(id3(100) + flac_head(8_000, 80_000)) == pytest.approx(10.0)  # after a short ID3 tag
    assert flac_seconds(flac_head(44_100, 0)) is None  # a live encoder's "unknown"
    assert seconds_bound(flac_head(44_100, 0), 15_000, 300.0) == 15_000 / MIN_BYTES_PER_S


def test_a_tagged_mp3_plays_its_declared_frames_and_an_untagged_one_is_priced_by_size() -> None:
    for tag in (b"Xing", b"Info"):
        assert mp3_seconds(mp3_head(tag, 1000, flags=6)) is None  # a tag without the frame count
        head = mp3_head(tag, 1000)
        assert mp3_seconds(head) == pytest.approx(1000 * 1152 / 44_100)
        assert mp3_seconds(id3(64) + head) == pytest.approx(1000 * 1152 / 44_100)
    assert mp3_seconds(mp3_head(b"Xing", 1000, mono=True)) == pytest.approx(1000 * 1152 / 44_100)
    vbri = bytearray(mp3_head(b"", 0))
    vbri[36:40], vbri[50:54] = b"VBRI", struct.pack(">I", 500)
    assert mp3_seconds(bytes(vbri)) == pytest.approx(500 * 1152 / 44_100)
    untagged = mp3_head(b"", 0)
    assert mp3_seconds(untagged) is None
    assert seconds_bound(untagged, 160_000, 300.0) == 160_000 / MIN_BYTES_PER_S


def test_only_the_first_head_bytes_count_as_the_worker_reads_them() -> None:
    """The router holds an inline clip whole, the worker reads ``HEAD_BYTES``: a header past them
    (after a long ID3 tag, e.g. a picture) is priced by size at both."""
    far = id3(HEAD_BYTES) + flac_head(44_100, 441_000)
    assert declared_seconds(far, len(far)) is None
    assert seconds_bound(far, len(far), 300.0) == seconds_bound(far[:HEAD_BYTES], len(far), 300.0)
