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


def test_chunks_round_trip_to_frames():
    frames = np.random.default_rng(0).integers(0, 255, (5, FRAME_SIDE, FRAME_SIDE, 3), dtype=np.uint8)
    chunks = chunk_frames(frames, 2)
    assert [len(frames_from_bytes(c)) for c in chunks] == [2, 2, 1]
    assert np.array_equal(np.asarray(frames_from_bytes(chunks[2])[0]), frames[4])


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
