"""What an image costs to decode, read from its header before anything decodes it.

The image engine's own cost is the same for every picture (each is resized to 224x224), but
decoding it is not: a 5000x5000 PNG of 73 KB takes about 500 ms of a core to decode and
resize, a 640x480 JPEG about 8. The router prices an image part by its header
(``workers.modalities.image``), so a tenant cannot send the one at the price of the other;
admission, placement and the tenant's compute quota all see the price.

Pillow's ``Image.open`` reads the header only. A baseline JPEG is priced at the reduced scale
``workers.image.decode_image`` decodes it at (``draft``), plus its bytes: libjpeg still
entropy-decodes every byte of the file at a reduced scale; a progressive one at full size
(its coefficients are decoded whole before any scaling: 237 ms for a 5000x5000 one of 4.5 MB,
where the baseline file takes 51).
"""

from __future__ import annotations

import io
import warnings

HEAD_BYTES = 32 * 1024
"""How much of an image ref the router reads with its size, to price it (inline data is read
whole: the header parse stops at the header): a JPEG's size marker follows its EXIF and ICC
segments, which are rarely longer. A header not found in them is priced at the pixel bound."""
DECODE_MS_PER_MPIXEL = 15.0
DECODE_MS_PER_MB = 7.0
"""Decode and resize per million decoded pixels (a JPEG's at its draft scale), and per
megabyte of the file (inflate, entropy decoding), fitted to ``workers.image.model_input`` on
the 2-core reference box, idle: a 5000x5000 PNG of 73 KB 395 ms (priced 376), 2000x2000 PNG
51 (60), 640x480 PNG of noise, 0.9 MB, 7.3 (11), 4000x3000 JPEG of 3.1 MB at 1/8 scale 25.5
(25), 640x480 JPEG 4.1 (5.2)."""


def declared_pixels(head: bytes) -> int | None:
    """Width x height as the header in ``head`` declares them (every pixel, whatever scale a
    decode would use), None when no supported header is found there."""
    found = _header(head)
    return found[0] * found[1] if found is not None else None


def decoded_pixels(head: bytes, max_pixels: int) -> int:
    """Pixels a decode of this image touches, from its first bytes: all of a PNG's or WebP's,
    a JPEG's at the scale it is decoded at. ``max_pixels`` (the bound a decode enforces) when
    no supported header is found in ``head``: such a part fails or costs the most, and a
    tenant may not make its price lower by hiding its header."""
    found = _header(head, drafted=True)
    return min(max_pixels, found[0] * found[1]) if found is not None else max_pixels


def _header(head: bytes, drafted: bool = False) -> tuple[int, int] | None:
    """(width, height) from the header in ``head``; ``drafted``: a baseline JPEG's at the scale
    ``workers.image.decode_image`` decodes it at."""
    # Here, not at the top: the modality registry (which imports this) loads no imaging library.
    from PIL import Image

    from workers.image import RESIZE_SHORTER_SIDE, SUPPORTED_FORMATS

    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":  # Pillow's WebP reader wants the whole file
        return _webp_size(head)
    try:
        with warnings.catch_warnings():
            # Pillow warns of a header over 89 M pixels, quoting its size: every distinct size
            # would be a log line and an entry in the warning registry, a client's to grow.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(head), formats=list(SUPPORTED_FORMATS))
        # A progressive JPEG is entropy-decoded at full size whatever the scale it is drawn at.
        if drafted and image.format == "JPEG" and not image.info.get("progressive"):
            image.draft("RGB", (RESIZE_SHORTER_SIDE, RESIZE_SHORTER_SIDE))
        return image.size
    except Exception:  # Pillow raises several types for bytes it cannot parse
        return None


def decode_ms(head: bytes, size: int, max_pixels: int) -> float:
    """Predicted ms of CPU to decode and resize an image of ``size`` bytes whose first bytes
    are ``head``."""
    return decoded_pixels(head, max_pixels) / 1e6 * DECODE_MS_PER_MPIXEL + size / 1e6 * DECODE_MS_PER_MB


def _webp_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from a WebP's first chunk (RFC 9649: ``VP8 ``, ``VP8L`` or ``VP8X``)."""
    chunk, body = head[12:16], head[20:30]
    if chunk == b"VP8X" and len(body) >= 10:
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if chunk == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        return int.from_bytes(body[6:8], "little") & 0x3FFF, int.from_bytes(body[8:10], "little") & 0x3FFF
    return None

