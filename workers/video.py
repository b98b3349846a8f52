"""Video parts: decode, sample frames, and fan them out as frame chunks to the image pool.

The video stage does no model work of its own. It decodes a clip (PyAV, off the event
loop; the container and codecs from an allow-list, opened without FFmpeg's probing:
``workers.media``), samples up to ``max_frames`` frames at ``fps``, and cuts them into chunks of
``frames_per_chunk``. Each chunk becomes an encode job on the IMAGE topic (so N image
replicas encode one video's chunks in parallel); a header part tells the assembler how
many chunk results to pool into the video's embedding (streams/policies/pooling.py).

Frames travel as raw RGB, 256x256, uint8 (``FRAMES_MIME``): the image encoder's own
resize-and-crop then takes the same centre 224x224 it takes from a photo.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
from PIL import Image

from schemas.errors import ErrorCode, WireError
from workers.audio import SAMPLE_RATE, decode_stream
from workers.image import decode_image
from workers.media import VIDEO_CODECS, VIDEO_CONTAINERS, check_audio_stream, check_codec, open_container

FRAMES_MIME = "video/x-mm-jpeg-frames"
"""A frame chunk on the image pool's topic: a MessagePack list of JPEG frames (256x256, quality
``FRAME_QUALITY``): about a tenth of the raw pixels' 196 KB per frame, so intermediates stay
compact, at a JPEG encode here and a decode on the image pool (each about a millisecond)."""
FRAME_SIDE = 256
FRAME_QUALITY = 90
MAX_FRAMES_PER_CHUNK = 64
PREPROCESSING_VERSION = "video-frames-256-jpeg90-v2"


@dataclass(frozen=True, slots=True)
class SampledVideo:
    frames: np.ndarray
    """uint8 [n, 256, 256, 3]."""
    duration_s: float
    has_audio: bool


MAX_FPS = 240
"""Decoded frames per second of clip past which a video is refused (frames are decoded to
find the sampled ones, so this bounds the work one clip can ask for)."""


def decode_video(data: bytes, max_seconds: float, max_frames: int, fps: float,
                 max_pixels: int = 25_000_000, max_decoded_pixels: int | None = None,
                 expired: Callable[[], bool] = lambda: False) -> SampledVideo:
    """Sample frames of an MP4/MOV, Matroska/WebM or AVI clip at ``fps`` (at most ``max_frames``).

    Before a frame is decoded: the container and the video codec must be on the allow-lists
    of ``workers.media``, the frame size (from the header) at most ``max_pixels``, the stated
    duration at most ``max_seconds``. While decoding: each frame's size again, its time, at
    most ``MAX_FPS`` frames per second of the limit, and at most ``max_decoded_pixels`` pixels
    decoded in all (width x height summed over every frame decoded, sampled or not: the
    decode work one clip may cost, whatever its timestamps say). A frame without a time is
    sampled (it counts as ``1 / fps`` after the one before), so a clip without timestamps
    costs ``max_frames`` frames, not every frame up to the bound. ``expired`` is asked before
    each frame: once it says so, decoding stops.

    Raises ``WireError``: ``payload_too_large`` past a bound, ``unsupported_media`` for bytes
    that are not an allowed video or do not decode, ``deadline_exceeded`` once ``expired``.
    """
    import av

    container = open_container(data, VIDEO_CONTAINERS, "video")
    with container:
        if not container.streams.video:
            raise WireError(ErrorCode.UNSUPPORTED_MEDIA, "the file has no video stream")
        stream = container.streams.video[0]
        check_codec(stream, VIDEO_CODECS, "video")
        _check_pixels(stream.codec_context.width, stream.codec_context.height, max_pixels)
        duration = _duration_s(container, stream)
        if duration is not None and duration > max_seconds:
            raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                            f"video is {duration:.1f} s long; the limit is {max_seconds:.0f} s")
        max_decoded = max(max_frames, int(max_seconds * MAX_FPS))
        frames: list[np.ndarray] = []
        next_t, last_t, decoded, pixels = 0.0, 0.0, 0, 0
        try:
            for frame in container.decode(stream):
                if expired():
                    raise WireError(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the video was decoded")
                decoded += 1
                if decoded > max_decoded:
                    raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                                    f"video has more than {max_decoded} frames in its first {max_seconds:.0f} s")
                _check_pixels(frame.width, frame.height, max_pixels)
                pixels += (frame.width or 0) * (frame.height or 0)
                if max_decoded_pixels is not None and pixels > max_decoded_pixels:
                    raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                                    f"video needs more than {max_decoded_pixels} decoded pixels for its "
                                    f"{max_frames} sampled frames (the decode limit)")
                t = float(frame.time) if frame.time is not None else (last_t + 1.0 / fps if decoded > 1 else 0.0)
                last_t = t
                if t > max_seconds:
                    raise WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"video runs past the limit of {max_seconds:.0f} s")
                if t + 1e-6 >= next_t:
                    frames.append(_square(frame.to_image()))
                    next_t = t + 1.0 / fps
                    if len(frames) >= max_frames:
                        break
        except (av.error.FFmpegError, ValueError, OSError) as exc:
            if not frames:
                raise WireError(ErrorCode.UNSUPPORTED_MEDIA,
                                f"the video stream does not decode ({exc.__class__.__name__})") from None
        if not frames:
            raise WireError(ErrorCode.UNSUPPORTED_MEDIA, "the video has no decodable frame")
        return SampledVideo(np.stack(frames), duration if duration is not None else last_t,
                            bool(container.streams.audio))


def _check_pixels(width: int | None, height: int | None, max_pixels: int) -> None:
    if (width or 0) * (height or 0) > max_pixels:
        raise WireError(ErrorCode.PAYLOAD_TOO_LARGE,
                        f"video frames of {width}x{height} exceed the limit of {max_pixels} pixels")


def _duration_s(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000.0
    return None


def _square(image: Image.Image) -> np.ndarray:
    """Shorter side to 256, centre crop 256x256, RGB uint8."""
    image = image.convert("RGB")
    w, h = image.size
    scale = FRAME_SIDE / min(w, h)
    size = (max(FRAME_SIDE, round(w * scale)), max(FRAME_SIDE, round(h * scale)))
    image = image.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - FRAME_SIDE) // 2, (size[1] - FRAME_SIDE) // 2
    return np.asarray(image.crop((left, top, left + FRAME_SIDE, top + FRAME_SIDE)), dtype=np.uint8)


def chunk_frames(frames: np.ndarray, per_chunk: int) -> list[bytes]:
    """Consecutive frame groups, ``per_chunk`` frames each (the last may be short), each group
    one ``FRAMES_MIME`` payload."""
    out = []
    for i in range(0, len(frames), per_chunk):
        jpegs = []
        for frame in frames[i:i + per_chunk]:
            buf = io.BytesIO()
            Image.fromarray(frame).save(buf, "JPEG", quality=FRAME_QUALITY)
            jpegs.append(buf.getvalue())
        out.append(msgpack.packb(jpegs, use_bin_type=True))
    return out


def frames_from_bytes(data: bytes) -> list[Image.Image]:
    """The frames of one chunk, as PIL images; raises ``WireError`` if it is not a bounded list
    of 256x256 JPEG frames (the list length and each frame's size are checked before decoding)."""
    try:
        jpegs = msgpack.unpackb(data, raw=False, max_array_len=MAX_FRAMES_PER_CHUNK, max_bin_len=FRAME_SIDE * FRAME_SIDE * 3,
                                max_str_len=0, max_map_len=0, max_ext_len=0)
    except Exception:
        jpegs = None
    if not isinstance(jpegs, list) or not jpegs or not all(isinstance(j, bytes) for j in jpegs):
        raise WireError(ErrorCode.INVALID_REQUEST, f"a frame chunk of {len(data or b'')} bytes is not a list of JPEG frames")
    frames = []
    for jpeg in jpegs:
        image = decode_image(jpeg, "image/jpeg", FRAME_SIDE * FRAME_SIDE)
        if image.size != (FRAME_SIDE, FRAME_SIDE):
            raise WireError(ErrorCode.INVALID_REQUEST, f"a frame of {image.size[0]}x{image.size[1]} is not {FRAME_SIDE}x{FRAME_SIDE}")
        frames.append(image)
    return frames


def extract_audio_wav(data: bytes, max_seconds: float) -> bytes | None:
    """The clip's first audio track as a 16 kHz mono 16-bit WAV, or None when it has none.

    Raises ``WireError`` when the track does not decode (the caller reports it beside the
    video's frames rather than failing the video).
    """
    import wave

    import av

    try:
        with open_container(data, VIDEO_CONTAINERS, "video") as container:
            if not container.streams.audio:
                return None
            check_audio_stream(container.streams.audio[0])
            samples = decode_stream(container, int(max_seconds * SAMPLE_RATE))
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"the audio track does not decode ({exc.__class__.__name__})") from None
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    return out.getvalue()
