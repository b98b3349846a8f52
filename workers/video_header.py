"""How long a video's soundtrack may play, read from its container before anything decodes it.

A video's frames go to the image pool and are priced there (``max_frames`` images). Its
soundtrack goes to the audio pool, where Whisper costs per 30 s window: a 120 s clip's
soundtrack costs four windows (about 6 s of a core on the 2-core box), 45 times its frames.
The router prices it (``workers.modalities.video``), and the video stage forwards no more of
it than was priced: both ends read the bound with this function from the same bytes.

MP4/MOV (its ``moov`` box names each track's handler and duration) and Matroska/WebM (its
``Tracks`` name each track's type, its ``Info`` the duration) are read; anything else, or an
index not within the bytes read (a ref's first 32 KiB, an MP4 whose index is at its end), is
priced at the longest soundtrack, ``max_seconds``. A file whose index declares no sound track
is priced none, and the stage forwards none of it whatever FFmpeg finds. A soundtrack that
declares fewer seconds than it plays is cut where it said it ends. The stage reads the whole
file, the router at most what it was given: the stage's bound is never above the router's
(what the router read whole is the same index in both).
"""

from __future__ import annotations

import struct
from typing import Iterator

MAX_BOXES = 4_096
"""Boxes looked at per call at most (a hostile file of empty boxes costs no more)."""


def _boxes(buf: bytes, start: int, end: int, budget: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, box end) of the complete boxes in ``buf[start:end]``, in order;
    stops at the first malformed or incomplete one."""
    at = start
    while at + 8 <= end and budget[0] > 0:
        budget[0] -= 1
        size, kind = struct.unpack_from(">I4s", buf, at)
        head = 8
        if size == 1:  # a 64-bit size follows
            if at + 16 > end:
                return
            size, head = struct.unpack_from(">Q", buf, at + 8)[0], 16
        elif size == 0:  # to the end of its parent
            size = end - at
        if size < head or at + size > end:
            return
        yield kind, at + head, at + size
        at += size


def _child(buf: bytes, start: int, end: int, kind: bytes, budget: list[int]) -> tuple[int, int] | None:
    return next(((s, e) for k, s, e in _boxes(buf, start, end, budget) if k == kind), None)


def _sound_seconds(buf: bytes, trak: tuple[int, int], budget: list[int]) -> float | None:
    """A ``trak``'s duration in seconds if it is a sound track, None if it is not; -1.0 when
    it is one whose duration cannot be read."""
    mdia = _child(buf, *trak, b"mdia", budget)
    if mdia is None:
        return None
    hdlr = _child(buf, *mdia, b"hdlr", budget)
    if hdlr is None or hdlr[1] - hdlr[0] < 12 or buf[hdlr[0] + 8:hdlr[0] + 12] != b"soun":
        return None
    mdhd = _child(buf, *mdia, b"mdhd", budget)
    if mdhd is None or mdhd[1] - mdhd[0] < 24:
        return -1.0
    s = mdhd[0]
    if buf[s] == 1:  # version 1: 64-bit times
        if mdhd[1] - s < 36:
            return -1.0
        timescale, duration = struct.unpack_from(">IQ", buf, s + 20)
    else:
        timescale, duration = struct.unpack_from(">II", buf, s + 12)
    return duration / timescale if timescale else -1.0


def soundtrack_seconds(data: bytes, max_seconds: float) -> float:
    """The most of a video's soundtrack worth pricing (s): 0 when its index declares no sound
    track, what it declares for them (the longest), else ``max_seconds``."""
    if data[:4] == _EBML:
        found = _matroska_seconds(data)
        return max_seconds if found is None else min(max_seconds, found)
    budget = [MAX_BOXES]
    moov = _child(data, 0, len(data), b"moov", budget)
    if moov is None:
        return max_seconds
    longest = 0.0
    for kind, start, end in _boxes(data, *moov, budget):
        if kind != b"trak":
            continue
        seconds = _sound_seconds(data, (start, end), budget)
        if seconds is not None and seconds < 0:
            return max_seconds  # a sound track of unknown length
        if seconds is not None:
            longest = max(longest, seconds)
    if budget[0] <= 0:
        return max_seconds  # not looked at whole
    return min(max_seconds, longest)


# -- Matroska / WebM ------------------------------------------------------------------------

_EBML, _SEGMENT, _INFO, _TRACKS, _CLUSTER = b"\x1a\x45\xdf\xa3", 0x18538067, 0x1549A966, 0x1654AE6B, 0x1F43B675
_TIMESCALE, _DURATION, _TRACK_ENTRY, _TRACK_TYPE, _AUDIO = 0x2AD7B1, 0x4489, 0xAE, 0x83, 2


def _vint(buf: bytes, at: int, keep_marker: bool) -> tuple[int, int] | None:
    """(value, its length) of the EBML variable-length integer at ``at``; None if malformed.
    A size of all ones (unknown) is returned as -1."""
    if at >= len(buf) or buf[at] == 0:
        return None
    length = 9 - buf[at].bit_length()
    if at + length > len(buf):
        return None
    value = int.from_bytes(buf[at:at + length], "big")
    if keep_marker:
        return value, length
    value &= (1 << (7 * length)) - 1
    return (-1 if value == (1 << (7 * length)) - 1 else value), length


def _elements(buf: bytes, start: int, end: int, budget: list[int]) -> Iterator[tuple[int, int, int]]:
    """(id, payload start, payload end) of the elements in ``buf[start:end]``; an element of
    unknown size runs to ``end``; stops at the first malformed or incomplete one."""
    at = start
    while at < end and budget[0] > 0:
        budget[0] -= 1
        eid, size = _vint(buf, at, True), None
        if eid is not None:
            size = _vint(buf, at + eid[1], False)
        if eid is None or size is None:
            return
        body = at + eid[1] + size[1]
        stop = end if size[0] < 0 else body + size[0]
        if stop > end:
            return
        yield eid[0], body, stop
        at = stop


def _matroska_seconds(buf: bytes) -> float | None:
    """A Matroska file's soundtrack length (s): 0 without an audio track; None where its
    ``Tracks``, or its duration beside an audio track, is not within ``buf``."""
    budget = [MAX_BOXES]
    segment = next(((s, e) for i, s, e in _elements(buf, 0, len(buf), budget) if i == _SEGMENT), None)
    if segment is None:
        return None
    scale, duration, audio = 1_000_000, None, None
    for eid, start, end in _elements(buf, *segment, budget):
        if eid == _CLUSTER:
            break  # the media: an index is before it
        if eid == _INFO:
            for iid, s, e in _elements(buf, start, end, budget):
                if iid == _TIMESCALE and 1 <= e - s <= 8:
                    scale = int.from_bytes(buf[s:e], "big")
                elif iid == _DURATION and e - s in (4, 8):
                    duration = struct.unpack(">f" if e - s == 4 else ">d", buf[s:e])[0]
        elif eid == _TRACKS:
            audio = any(tid == _TRACK_ENTRY and _is_audio(buf, s, e, budget)
                        for tid, s, e in _elements(buf, start, end, budget))
        if audio is not None and (not audio or duration is not None):
            break
    if audio is None or budget[0] <= 0:
        return None
    if not audio:
        return 0.0
    if duration is None or not (duration >= 0) or scale <= 0:
        return None
    return duration * scale / 1e9



def _is_audio(buf: bytes, start: int, end: int, budget: list[int]) -> bool:
    return any(eid == _TRACK_TYPE and e - s == 1 and buf[s] == _AUDIO for eid, s, e in _elements(buf, start, end, budget))

