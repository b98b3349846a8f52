import numpy as np
import pytest

from mmstream.samples import video
from schemas.errors import ErrorCode, WireError
from workers.video import FRAME_SIDE, chunk_frames, decode_video, frames_from_bytes


def test_samples_frames_at_the_asked_rate_and_squares_them():
    clip = video(["chelsea", "coffee", "astronaut"], seconds_each=1.0)
    v = decode_video(clip, max_seconds=60, max_frames=16, fps=1.0)
    assert v.frames.shape == (3, FRAME_SIDE, FRAME_SIDE, 3) and v.frames.dtype == np.uint8
    assert 2.5 <= v.duration_s <= 3.5 and not v.has_audio
    assert len(decode_video(clip, 60, max_frames=2, fps=1.0).frames) == 2


def test_chunks_round_trip_to_frames_and_stay_compact():
    clip = decode_video(video(["chelsea", "coffee", "rocket", "astronaut", "chelsea"], seconds_each=1.0), 60, 16, 1.0)
    chunks = chunk_frames(clip.frames, 2)
    assert [len(frames_from_bytes(c)) for c in chunks] == [2, 2, 1]
    back = np.asarray(frames_from_bytes(chunks[2])[0]).astype(np.int16)
    assert np.abs(back - clip.frames[4].astype(np.int16)).mean() < 4  # JPEG at quality 90: close, not equal
    assert sum(map(len, chunks)) < clip.frames.nbytes / 4  # compact intermediates: raw frames are 196 KB each


def test_guards():
    clip = video(["chelsea"] * 4, seconds_each=1.0)
    with pytest.raises(WireError) as too_long:
        decode_video(clip, max_seconds=2, max_frames=16, fps=1.0)
    assert too_long.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    with pytest.raises(WireError) as junk:
        decode_video(b"\x00\x00\x00\x18ftypmp42 not really a video", 60, 16, 1.0)
    assert junk.value.code == ErrorCode.UNSUPPORTED_MEDIA
    with pytest.raises(WireError):
        frames_from_bytes(b"\x00" * 10)
    with pytest.raises(WireError):  # too many frames for one chunk: refused before any is decoded
        frames_from_bytes(chunk_frames(np.zeros((65, FRAME_SIDE, FRAME_SIDE, 3), np.uint8), 65)[0])


class _Frame:
    def __init__(self, width=320, height=240):
        self.time, self.width, self.height = None, width, height

    def to_image(self):
        from PIL import Image

        return Image.new("RGB", (self.width, self.height))


class _UntimedClip:
    """A container whose frames carry no timestamps (and whose stream states no duration)."""

    def __init__(self, n):
        from types import SimpleNamespace

        self.n, self.decoded = n, 0
        stream = SimpleNamespace(codec_context=SimpleNamespace(width=320, height=240), duration=None, time_base=None)
        self.streams = SimpleNamespace(video=[stream], audio=[])
        self.duration = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def decode(self, stream):
        for _ in range(self.n):
            self.decoded += 1
            yield _Frame()


def test_a_clip_without_timestamps_decodes_max_frames_not_every_frame_up_to_the_bound(monkeypatch):
    import workers.video as wv

    clip = _UntimedClip(10_000)
    monkeypatch.setattr(wv, "open_container", lambda data, allowed, kind: clip)
    monkeypatch.setattr(wv, "check_codec", lambda stream, allowed, kind: None)
    v = decode_video(b"untimed", max_seconds=120, max_frames=16, fps=1.0)
    assert len(v.frames) == 16 and clip.decoded == 16


def test_decode_work_is_bounded_by_pixels_whatever_the_timestamps_say():
    clip = video(["chelsea"] * 4, seconds_each=1.0, fps=8)  # 32 frames of 320x240
    with pytest.raises(WireError) as e:
        decode_video(clip, 60, max_frames=16, fps=1.0, max_decoded_pixels=10 * 320 * 240)
    assert e.value.code == ErrorCode.PAYLOAD_TOO_LARGE and "decoded pixels" in e.value.message
    assert len(decode_video(clip, 60, 16, 1.0, max_decoded_pixels=40 * 320 * 240).frames) == 4


def test_decoding_stops_once_the_deadline_passes():
    clip = video(["chelsea"] * 4, seconds_each=1.0, fps=8)
    asked = []

    def expired():
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(WireError) as e:
        decode_video(clip, 60, 16, 1.0, expired=expired)
    assert e.value.code == ErrorCode.DEADLINE_EXCEEDED and len(asked) == 4
