"""How long a clip may play, read from its bytes before anything decodes them.

Whisper's cost is per 30 s window of speech: a 300 s clip costs up to ten times a 5 s one.
The router prices an audio part by the windows its duration bound allows
(``workers.modalities.audio``), and the audio worker decodes no more than that bound
(``workers.modalities.audio_runner``), so a clip cannot be charged one window and spend ten.
Both ends compute the bound with this function from the same bytes (a ref's payload is held to
the size it was priced at, ``EncodeJob.ref_bytes``), so the price read at admission stays the
price.

- **PCM WAV**: exact. Its ``fmt`` chunk's byte rate and the file's size give the duration, and
  the decoder plays PCM at that same byte rate: a header that claims a higher rate decodes
  to as few seconds as it claims.
- **Anything else** (FLAC, MP3, Ogg, a WAV holding compressed audio): the size at
  ``MIN_BYTES_PER_S``, the lowest rate Opus speaks at (6 kbit/s), so no clip a client can
  send plays longer than its bound. A file of higher bitrate is priced over what it plays: an
  MP3 at 128 kbit/s at 21x (at most the longest clip). Pricing by what a compressed header
  claims (an MP3 frame's bitrate, FLAC's sample count) is not built: it would be safe, since
  the worker decodes no more than the bound, but a variable-bitrate file's first frame says
  little of the rest. PCM WAV is what pays exactly.

Every bound is at most ``max_seconds`` (``limits.max_audio_seconds``), which the decoder
enforces for every clip anyway.
"""

from __future__ import annotations

import math
import struct

WINDOW_S = 30.0
"""Whisper's window: the unit an audio part is priced in."""
MIN_BYTES_PER_S = 750.0
"""The fewest bytes per second a compressed clip plays at (Opus's lowest, 6 kbit/s)."""
SLACK_S = 0.5
"""Decoders disagree on a clip's last frame: the worker allows this much past the bound."""
HEAD_BYTES = 512
"""How far into a WAV its ``fmt`` chunk is looked for (after any JUNK or LIST chunks before it)."""
_PCM, _EXTENSIBLE = 1, 0xFFFE
_PCM_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"


def _fmt_chunk(head: bytes) -> bytes | None:
    """The body of a RIFF/WAVE file's ``fmt `` chunk, if it lies within ``head``."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    at = 12
    while at + 8 <= min(len(head), HEAD_BYTES):
        name, size = head[at:at + 4], struct.unpack_from("<I", head, at + 4)[0]
        if name == b"fmt ":
            body = head[at + 8:at + 8 + size]
            return body if len(body) == size else None
        at += 8 + size + (size & 1)  # chunks are word-aligned
    return None


def pcm_wav_seconds(head: bytes, size: int) -> float | None:
    """Seconds a PCM WAV of ``size`` bytes plays at most, from its ``fmt`` chunk (every byte
    counted as samples); None for anything else (another container, compressed samples, a
    header that does not parse or does not add up)."""
    fmt = _fmt_chunk(head)
    if fmt is None or len(fmt) < 16:
        return None
    tag, channels, rate, byte_rate, align, bits = struct.unpack_from("<HHIIHH", fmt, 0)
    if tag == _EXTENSIBLE:  # the sub-format GUID says what the samples are
        if len(fmt) < 40 or struct.unpack_from("<H", fmt, 24)[0] != _PCM or fmt[26:40] != _PCM_GUID_TAIL:
            return None
    elif tag != _PCM:
        return None
    if channels < 1 or rate < 1 or bits < 8 or bits % 8 or byte_rate != rate * channels * (bits // 8):
        return None
    return max(0, size - 44) / byte_rate  # 44: the least a WAV's chunks before its samples take


def seconds_bound(head: bytes, size: int, max_seconds: float) -> float:
    """The most a clip of ``size`` bytes whose first bytes are ``head`` may play (s)."""
    exact = pcm_wav_seconds(head, size)
    return min(max_seconds, exact if exact is not None else size / MIN_BYTES_PER_S)


def windows(seconds: float) -> float:
    """Whisper windows a clip of ``seconds`` takes (at least one)."""
    return float(max(1, math.ceil(seconds / WINDOW_S - 1e-9)))
