"""A video's soundtrack bound, read from its MP4 index before anything decodes it: what its
sound tracks declare, none without one, the longest soundtrack where it cannot tell."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

pytest.importorskip("av")

from mmstream.samples import video  # noqa: E402
from workers.video_header import MAX_BOXES, soundtrack_seconds  # noqa: E402


def tone_wav(seconds: float, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        t = np.arange(int(seconds * rate)) / rate
        w.writeframes((np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2").tobytes())
    return buf.getvalue()


def box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", 8 + len(payload)) + kind + payload


def sound_trak(timescale: int, duration: int, version: int = 0, handler: bytes = b"soun") -> bytes:
    if version == 1:
        mdhd = bytes([1, 0, 0, 0]) + b"\0" * 16 + struct.pack(">IQ", timescale, duration) + b"\0" * 4
    else:
        mdhd = b"\0" * 4 + b"\0" * 8 + struct.pack(">II", timescale, duration) + b"\0" * 4
    hdlr = b"\0" * 8 + handler + b"\0" * 12
    return box(b"trak", box(b"mdia", box(b"mdhd", mdhd) + box(b"hdlr", hdlr)))


def test_an_mp4s_sound_track_is_priced_at_what_it_declares_and_a_silent_one_at_none() -> None:
    with_sound = video(["chelsea", "coffee"], seconds_each=2.0, soundtrack=tone_wav(3.0))
    assert 2.9 <= soundtrack_seconds(with_sound, 120.0) <= 3.2
    assert soundtrack_seconds(video(["chelsea"], seconds_each=2.0), 120.0) == 0.0
    assert soundtrack_seconds(with_sound, 2.0) == 2.0  # never past the longest


def test_what_it_cannot_read_is_priced_at_the_longest_soundtrack() -> None:
    mp4 = video(["chelsea", "coffee"], seconds_each=2.0, soundtrack=tone_wav(3.0))
    assert soundtrack_seconds(mp4[:4096], 120.0) == 120.0  # the index at the end: not within the head
    assert soundtrack_seconds(b"RIFF" + b"\0" * 4000, 120.0) == 120.0  # neither MP4 nor Matroska (an AVI)
    assert soundtrack_seconds(b"\x00\x00\x00\x01moov" + b"\xff" * 8, 120.0) == 120.0  # a size past the end
    assert soundtrack_seconds(b"", 120.0) == 120.0


def test_hand_made_indexes_version_1_times_unknown_lengths_and_too_many_boxes() -> None:
    moov = box(b"moov", sound_trak(48_000, 48_000 * 65, version=1) + sound_trak(1000, 5000, handler=b"vide"))
    assert soundtrack_seconds(box(b"ftyp", b"isom") + moov, 120.0) == 65.0
    assert soundtrack_seconds(box(b"moov", sound_trak(0, 10)), 120.0) == 120.0  # no timescale: unknown
    assert soundtrack_seconds(box(b"moov", sound_trak(1000, 5000, handler=b"vide")), 120.0) == 0.0
    flood = box(b"moov", box(b"free", b"") * (MAX_BOXES + 10))
    assert soundtrack_seconds(flood, 120.0) == 120.0  # not looked at whole


def test_a_webm_is_read_from_its_tracks_and_info_before_its_clusters() -> None:
    silent = video(["chelsea"], seconds_each=2.0, fmt="webm", codec="libvpx")
    assert soundtrack_seconds(silent, 120.0) == 0.0
    assert soundtrack_seconds(silent[:40], 120.0) == 120.0  # its tracks not within the bytes


def ebml(eid: int, payload: bytes) -> bytes:
    assert len(payload) < 127
    return eid.to_bytes((eid.bit_length() + 7) // 8, "big") + bytes([0x80 | len(payload)]) + payload


def test_a_hand_made_matroska_index_says_its_audio_and_its_length() -> None:
    info = ebml(0x1549A966, ebml(0x2AD7B1, (1_000_000).to_bytes(3, "big")) + ebml(0x4489, struct.pack(">d", 65_000.0)))
    audio = ebml(0x1654AE6B, ebml(0xAE, ebml(0x83, b"\x01")) + ebml(0xAE, ebml(0x83, b"\x02")))
    head = ebml(0x1A45DFA3, b"\x42\x82\x84webm")
    unknown_size = b"\x18\x53\x80\x67\x01\xff\xff\xff\xff\xff\xff\xff"  # a live stream's Segment
    assert soundtrack_seconds(head + unknown_size + info + audio + b"\x1f\x43\xb6\x75\x80", 120.0) == 65.0
    assert soundtrack_seconds(head + unknown_size + audio + info, 300.0) == 65.0  # either order
    assert soundtrack_seconds(head + unknown_size + audio, 120.0) == 120.0  # audio of no stated length
    video_only = ebml(0x1654AE6B, ebml(0xAE, ebml(0x83, b"\x01")))
    assert soundtrack_seconds(head + unknown_size + video_only, 120.0) == 0.0
    assert soundtrack_seconds(head + unknown_size + b"\x1f\x43\xb6\x75\x80" + audio, 120.0) == 120.0  # media first
