"""Containers and codecs from an allow-list, chosen from the bytes before FFmpeg probes them;
every bound before the allocation; every refusal a stable code."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

av = pytest.importorskip("av")

from mmstream.samples import photo, video  # noqa: E402
from schemas.errors import ErrorCode, WireError  # noqa: E402
from workers import video as video_module  # noqa: E402
from workers.audio import decode_audio  # noqa: E402
from workers.media import AUDIO_CONTAINERS, VIDEO_CONTAINERS, sniff  # noqa: E402
from workers.video import decode_video, extract_audio_wav  # noqa: E402

PNG = photo("coffee", "PNG")


def refused(fn) -> WireError:
    with pytest.raises(WireError) as e:
        fn()
    return e.value


def hostile_files(tmp_path) -> dict[str, bytes]:
    """Media that make FFmpeg's probing pick a demuxer that reads other files."""
    (tmp_path / "frame.png").write_bytes(PNG)
    return {
        "ffconcat": b"ffconcat version 1.0\nfile frame.png\n",
        "ffconcat, absolute": f"ffconcat version 1.0\nfile {tmp_path / 'frame.png'}\n".encode(),
        "hls": b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nframe.png\n#EXT-X-ENDLIST\n",
        "image2 (a png)": PNG,
        "sdp": b"v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\nm=video 5004 RTP/AVP 96\n",
        "subtitles": b"WEBVTT\n\n00:00.000 --> 00:01.000\nhi\n",
        "fake ftyp": b"\x00\x00\x00\x18ftypmp42" + b"ffconcat version 1.0\nfile frame.png\n",
    }


def test_the_ffconcat_attack_and_its_variants_fail_for_video_and_audio(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a relative path in the script would be looked up
    for name, data in hostile_files(tmp_path).items():
        assert refused(lambda: decode_video(data, 60, 16, 1.0)).code == ErrorCode.UNSUPPORTED_MEDIA, name
        assert refused(lambda: decode_audio(data, None, 10)).code == ErrorCode.UNSUPPORTED_MEDIA, name
        assert refused(lambda: extract_audio_wav(data, 10)).code == ErrorCode.UNSUPPORTED_MEDIA, name


def test_only_allow_listed_signatures_are_sniffed():
    assert sniff(video(["coffee"]), VIDEO_CONTAINERS) == "mp4"
    assert sniff(b"\x1a\x45\xdf\xa3rest", VIDEO_CONTAINERS) == "matroska"
    assert sniff(b"RIFF\x00\x00\x00\x00AVI LIST", VIDEO_CONTAINERS) == "avi"
    assert sniff(b"RIFF\x00\x00\x00\x00WAVEfmt ", VIDEO_CONTAINERS) is None  # a WAV is no video
    assert sniff(b"RIFF\x00\x00\x00\x00WAVEfmt ", AUDIO_CONTAINERS) == "wav"
    assert sniff(b"ID3\x04", AUDIO_CONTAINERS) == "mp3" and sniff(b"fLaC", AUDIO_CONTAINERS) == "flac"
    assert sniff(b"ffconcat version 1.0", AUDIO_CONTAINERS) is None and sniff(b"", VIDEO_CONTAINERS) is None


@pytest.mark.parametrize("fmt,codec", [("webm", "libvpx"), ("avi", "mpeg4"), ("matroska", "h264"), ("mp4", "h264")])
def test_allowed_containers_and_codecs_decode(fmt, codec):
    assert decode_video(video(["coffee"], fmt=fmt, codec=codec), 60, 16, 1.0).frames.shape[0] == 1


def frames_clip(fmt: str, codec: str, side: int = 64, n: int = 4) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=4)
        stream.width = stream.height = side
        stream.pix_fmt = "rgb24"
        for _ in range(n):
            frame = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,codec", [("mp4", "png"), ("avi", "rawvideo")])
def test_a_codec_off_the_list_is_refused_before_decoding(fmt, codec):
    e = refused(lambda: decode_video(frames_clip(fmt, codec), 60, 16, 1.0))
    assert e.code == ErrorCode.UNSUPPORTED_MEDIA and codec in e.message


def test_frame_size_and_frame_count_are_bounded_before_the_work(monkeypatch):
    clip = video(["coffee"] * 4, seconds_each=1.0)  # 320x240, 8 fps, 32 frames
    e = refused(lambda: decode_video(clip, 60, 16, 1.0, max_pixels=320 * 240 - 1))
    assert e.code == ErrorCode.PAYLOAD_TOO_LARGE and "pixels" in e.message
    monkeypatch.setattr(video_module, "MAX_FPS", 0.1)  # at most max(16, 60 x 0.1) = 16 frames decoded
    e = refused(lambda: decode_video(clip, 60, 16, 0.05))
    assert e.code == ErrorCode.PAYLOAD_TOO_LARGE and "frames" in e.message


def wav(channels: int, rate: int = 16_000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(rate * channels, "<i2").tobytes())
    return out.getvalue()


def adpcm_wav() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("adpcm_ms", rate=16_000, layout="mono")
        n = stream.codec_context.frame_size or 1024
        for i in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, n), np.int16), format="s16", layout="mono")
            frame.rate, frame.pts = 16_000, i * n
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def test_audio_codec_channels_and_rate_come_from_allow_lists():
    assert len(decode_audio(wav(2), "audio/wav", 10)) == 16_000
    e = refused(lambda: decode_audio(wav(16), "audio/wav", 10))
    assert e.code == ErrorCode.UNSUPPORTED_MEDIA and "channels" in e.message
    e = refused(lambda: decode_audio(adpcm_wav(), "audio/wav", 10))
    assert e.code == ErrorCode.UNSUPPORTED_MEDIA and "adpcm_ms" in e.message


def test_no_refusal_quotes_the_bytes():
    secret = b"\x13\x37TOPSECRET-CLAIM-CHECK" * 4
    for fn in (lambda: decode_audio(secret, None, 10), lambda: decode_video(secret, 60, 16, 1.0)):
        e = refused(fn)
        assert "TOPSECRET" not in e.message and secret[:8].hex() not in e.message and str(len(secret)) not in e.message
