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
- **FLAC**: exact. Its ``STREAMINFO`` block (the first, by the format's rule) says how many
  samples the stream holds and at what rate.
- **MP3 with a Xing, Info or VBRI tag** (what LAME, ffmpeg and most encoders write in the first
  frame): exact, from the number of frames it declares, at the samples per frame and rate of
  the first frame's header. An MP3 without one is priced as below: its first frame's bitrate
  says little of a variable-bitrate file's rest.
- **Anything else** (Ogg, whose length is only in its last page; a WAV holding compressed audio;
  a FLAC or MP3 whose header does not parse or lies beyond the first ``HEAD_BYTES``, e.g. after
  an ID3 tag carrying a picture): the size at ``MIN_BYTES_PER_S``, the lowest rate Opus speaks
  at (6 kbit/s), so no clip a client can send plays longer than its bound. A file of higher
  bitrate is priced over what it plays: an Ogg Vorbis at 128 kbit/s at 21x (at most the
  longest clip).

A header that claims fewer seconds than its stream holds costs its sender only: the worker
decodes no more than the bound it claimed (plus ``SLACK_S``) and refuses the clip
(``payload_too_large``). So trusting what a header declares is safe, and an honest file is
priced at what it plays.

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
"""How far into a clip its header is looked for: a WAV's ``fmt`` chunk (after any JUNK or LIST
chunks before it), FLAC's ``STREAMINFO``, an MP3's first frame (after a short ID3 tag)."""
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


def _after_id3(head: bytes) -> int:
    """Where the audio starts after an ID3v2 tag at the start of ``head`` (0 if none)."""
    if len(head) < 10 or head[:3] != b"ID3" or any(b & 0x80 for b in head[6:10]):
        return 0
    size = (head[6] << 21) | (head[7] << 14) | (head[8] << 7) | head[9]  # "syncsafe": 7 bits a byte
    return 10 + size + (10 if head[5] & 0x10 else 0)  # header, tag, footer


def flac_seconds(head: bytes) -> float | None:
    """Seconds a FLAC stream plays, from its ``STREAMINFO`` block; None for anything else or a
    stream that does not say (a total of 0 samples: unknown, as a live encoder writes)."""
    at = _after_id3(head)
    info = head[at:at + 42]
    if len(info) < 42 or info[:4] != b"fLaC" or info[4] & 0x7F != 0 or info[5:8] != b"\x00\x00\x22":
        return None
    packed = int.from_bytes(info[18:26], "big")  # rate 20 bits, channels 3, bits 5, samples 36
    rate, samples = packed >> 44, packed & ((1 << 36) - 1)
    return samples / rate if rate and samples else None


_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
"""Sample rates by the header's version bits (3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5) and rate index."""


def mp3_seconds(head: bytes) -> float | None:
    """Seconds an MP3 plays, from the frame count its first frame's Xing, Info or VBRI tag
    declares; None for anything else, an MP3 without such a tag, or a header that does not parse."""
    at = _after_id3(head)
    frame = head[at:]
    if len(frame) < 4 or frame[0] != 0xFF or frame[1] & 0xE0 != 0xE0:
        return None
    version, layer, rate_index = (frame[1] >> 3) & 3, (frame[1] >> 1) & 3, (frame[2] >> 2) & 3
    if version not in _MP3_RATES or layer != 1 or rate_index == 3:  # layer bits 01: Layer III
        return None
    rate = _MP3_RATES[version][rate_index]
    per_frame = 1152 if version == 3 else 576
    mono = frame[3] >> 6 == 3
    side = (17 if mono else 32) if version == 3 else (9 if mono else 17)
    xing = frame[4 + side:4 + side + 12]
    frames = None
    if xing[:4] in (b"Xing", b"Info") and len(xing) == 12 and xing[7] & 1:  # flag 1: frame count present
        frames = struct.unpack_from(">I", xing, 8)[0]
    elif frame[36:40] == b"VBRI" and len(frame) >= 54:
        frames = struct.unpack_from(">I", frame, 50)[0]
    return frames * per_frame / rate if frames else None


def declared_seconds(head: bytes, size: int) -> float | None:
    """Seconds a clip plays as its header declares it (see above), or None where it does not.
    Only the first ``HEAD_BYTES`` count, whatever ``head`` holds: the router (which has an inline
    clip whole) and the worker must read the same bound from the same bytes."""
    head = head[:HEAD_BYTES]
    for seconds in (pcm_wav_seconds(head, size), flac_seconds(head), mp3_seconds(head)):
        if seconds is not None:
            return seconds
    return None


def seconds_bound(head: bytes, size: int, max_seconds: float) -> float:
    """The most a clip of ``size`` bytes whose first bytes are ``head`` may play (s)."""
    exact = declared_seconds(head, size)
    return min(max_seconds, exact if exact is not None else size / MIN_BYTES_PER_S)


def windows(seconds: float) -> float:
    """Whisper windows a clip of ``seconds`` takes (at least one)."""
    return float(max(1, math.ceil(seconds / WINDOW_S - 1e-9)))
