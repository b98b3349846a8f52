"""Opening audio and video containers safely: an allow-list of containers and codecs, chosen
from the bytes before FFmpeg sees them.

FFmpeg's format probing picks whatever demuxer the bytes match best, and some demuxers read
other files: a 50-byte ``ffconcat`` script makes the ``concat`` demuxer open a path of the
worker's own disk; ``hls`` playlists, ``image2`` patterns and friends do the like. So
probing never runs here:

1. ``sniff`` reads the container's signature (``ftyp`` box, EBML, ``RIFF``...) and maps it to
   one demuxer of the allow-list (``VIDEO_CONTAINERS`` / ``AUDIO_CONTAINERS``); anything else
   is ``unsupported_media`` before FFmpeg is called;
2. ``open_container`` opens the bytes with that demuxer forced (no probing), nested opens
   forbidden (``protocol_whitelist=none``: a demuxer that tries to open another file or URL
   fails) and the MOV demuxer's external data references off; the demuxer FFmpeg reports
   is checked against the allow-list once more;
3. ``check_codec`` refuses a stream whose codec is not on the list, before a frame is decoded.

Every refusal is a ``WireError`` with a stable code whose message names what was found,
never the bytes. ``av`` is imported inside the functions: importing this module loads no FFmpeg.
"""

from __future__ import annotations

import io
from typing import Any

from schemas.errors import ErrorCode, WireError

# demuxer name (FFmpeg's, as ``format=`` takes it) -> what the error messages call it
VIDEO_CONTAINERS = {"mp4": "MP4/MOV", "matroska": "Matroska/WebM", "avi": "AVI"}
AUDIO_CONTAINERS = {"wav": "WAV", "flac": "FLAC", "ogg": "Ogg", "mp3": "MP3"}
# A demuxer reports its family ("mov,mp4,m4a,3gp,3g2,mj2"): any of these names is ours.
_FAMILY = {"mp4": {"mov", "mp4", "m4a", "3gp", "3g2", "mj2"}, "matroska": {"matroska", "webm"}, "avi": {"avi"},
           "wav": {"wav"}, "flac": {"flac"}, "ogg": {"ogg"}, "mp3": {"mp3"}}

VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg", "libdav1d", "libvpx", "libvpx-vp9"})
AUDIO_CODECS = frozenset({
    "aac", "mp3", "mp3float", "opus", "libopus", "vorbis", "libvorbis", "flac",
    "pcm_s16le", "pcm_s16be", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le", "pcm_u8", "pcm_alaw", "pcm_mulaw",
})  # fmt: skip
MAX_AUDIO_CHANNELS = 8
MAX_SAMPLE_RATE = 384_000

_OPTIONS = {"protocol_whitelist": "none", "enable_drefs": "0", "use_absolute_path": "0"}
"""Demuxer options: no nested opens of any protocol; MOV's external references off."""


def sniff(data: bytes, allowed: dict[str, str]) -> str | None:
    """The allow-listed demuxer whose signature ``data`` starts with, or None."""
    head = bytes(data[:16])
    found: str | None = None
    if head[4:8] == b"ftyp":
        found = "mp4"
    elif head[:4] == b"\x1a\x45\xdf\xa3":
        found = "matroska"
    elif head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        found = "avi"
    elif head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        found = "wav"
    elif head[:4] == b"fLaC":
        found = "flac"
    elif head[:4] == b"OggS":
        found = "ogg"
    elif head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        found = "mp3"
    return found if found in allowed else None


def open_container(data: bytes, allowed: dict[str, str], what: str) -> Any:
    """An opened PyAV input container for ``data``, its demuxer from ``allowed`` (see the
    module doc). ``what`` names the media in messages ("video", "audio").

    Raises ``WireError(unsupported_media)`` for bytes of no allowed container or that the
    demuxer cannot read.
    """
    import av

    demuxer = sniff(data, allowed)
    if demuxer is None:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA,
                        f"not a supported {what} container; supported: {', '.join(allowed.values())}")
    try:
        container = av.open(io.BytesIO(bytes(data)), mode="r", format=demuxer, options=dict(_OPTIONS))
    except MemoryError:
        raise
    except Exception as exc:  # FFmpeg's errors surface as several av.error types (and ValueError)
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA,
                        f"{allowed[demuxer]} data does not open as {what} ({exc.__class__.__name__})") from None
    names = set(str(container.format.name or "").split(","))
    if not names & _FAMILY[demuxer]:  # FFmpeg answered with another demuxer than the one forced
        container.close()
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"not a supported {what} container")
    return container


def codec_name(stream: Any) -> str:
    ctx = stream.codec_context
    return str(getattr(ctx, "name", "") or getattr(getattr(ctx, "codec", None), "name", "") or "")


def check_codec(stream: Any, allowed: frozenset[str], what: str) -> None:
    """Refuse ``stream`` unless its codec is in ``allowed`` (``unsupported_media``)."""
    name = codec_name(stream)
    if name not in allowed:
        shown = name if name.replace("_", "").isalnum() and len(name) <= 20 else "unknown"
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"the {what} codec {shown} is not served")


def check_audio_stream(stream: Any) -> None:
    """The audio codec allow-list and the channel and rate bounds, from the header."""
    check_codec(stream, AUDIO_CODECS, "audio")
    ctx = stream.codec_context
    channels = getattr(ctx, "channels", None) or 0
    rate = getattr(ctx, "sample_rate", None) or 0
    if channels > MAX_AUDIO_CHANNELS:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"audio with {channels} channels; at most {MAX_AUDIO_CHANNELS}")
    if rate > MAX_SAMPLE_RATE:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"audio at {rate} Hz; at most {MAX_SAMPLE_RATE}")
