"""An image's decode priced from its header (workers.image_header): the pixels a decode will
touch, read from the first bytes only, for every format the image stage decodes."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from workers.image_header import HEAD_BYTES, decode_ms, decoded_pixels

BOUND = 25_000_000


def encoded(fmt: str, width: int, height: int, mode: str = "RGB", **kw) -> bytes:
    pixels = np.random.default_rng(width * height).integers(0, 255, (height, width, len(mode)), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize("fmt,kw,mode", [("PNG", {}, "RGB"), ("WEBP", {}, "RGB"), ("WEBP", {"lossless": True}, "RGB"),
                                         ("WEBP", {}, "RGBA")])
def test_the_pixels_come_from_the_first_bytes_of_a_file_far_larger(fmt, kw, mode) -> None:
    data = encoded(fmt, 1600, 1200, mode, **kw)
    assert len(data) > 4 * HEAD_BYTES  # noise: the header is all the price sees
    assert decoded_pixels(data[:HEAD_BYTES], BOUND) == 1600 * 1200
    assert decoded_pixels(encoded(fmt, 301, 77, mode, **kw), BOUND) == 301 * 77


def test_a_jpeg_is_priced_at_the_scale_it_is_decoded_at() -> None:
    data = encoded("JPEG", 1600, 1200)
    assert decoded_pixels(data[:HEAD_BYTES], BOUND) == 400 * 300  # 1/4: the shorter side still >= 256
    assert decoded_pixels(encoded("JPEG", 300, 200), BOUND) == 300 * 200


def test_what_shows_no_header_is_priced_at_the_bound() -> None:
    assert decoded_pixels(b"", BOUND) == BOUND
    assert decoded_pixels(b"GIF89a" + bytes(100), BOUND) == BOUND
    photo = encoded("JPEG", 640, 480)
    exif = b"\xff\xe1" + (40_000).to_bytes(2, "big") + bytes(39_998)  # a valid 40 KB APP1 segment before the size
    late = photo[:2] + exif + photo[2:]
    assert decoded_pixels(late, BOUND) == 640 * 480  # all of it: found
    assert decoded_pixels(late[:HEAD_BYTES], BOUND) == BOUND  # cut before the size marker: the bound
    assert decoded_pixels(b"RIFF\x00\x00\x00\x00WEBPVP8 ", BOUND) == BOUND


def test_a_flat_picture_of_many_pixels_costs_what_its_pixels_cost_not_its_bytes() -> None:
    flat = io.BytesIO()
    Image.new("RGB", (5000, 5000)).save(flat, "PNG")
    big, photo = flat.getvalue(), encoded("JPEG", 640, 480)
    assert len(big) < 2 * len(photo)  # about as many bytes ...
    assert decode_ms(big[:HEAD_BYTES], len(big), BOUND) > 50 * decode_ms(photo, len(photo), BOUND)  # ... not the cost
    assert decoded_pixels(big, 1_000_000) == 1_000_000  # never past the bound a decode enforces


def test_a_progressive_jpeg_is_priced_at_full_size() -> None:
    baseline, progressive = encoded("JPEG", 1600, 1200), encoded("JPEG", 1600, 1200, progressive=True)
    assert decoded_pixels(baseline, BOUND) == 400 * 300
    assert decoded_pixels(progressive, BOUND) == 1600 * 1200


def test_a_header_past_pillows_warning_size_warns_no_one() -> None:
    import warnings
    import zlib

    ihdr = (12_000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])  # 144 M pixels: past the warning, under the error
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        assert decoded_pixels(png, BOUND) == BOUND
        assert decoded_pixels(png, 200_000_000) == 144_000_000
    assert not [w for w in caught if "DecompressionBomb" in type(w.message).__name__]


def test_declared_pixels_are_every_pixel_whatever_the_decode_scale() -> None:
    from workers.image_header import declared_pixels

    assert declared_pixels(encoded("JPEG", 1600, 1200)) == 1600 * 1200  # decoded at 1/4, declared whole
    assert declared_pixels(encoded("PNG", 301, 77)) == 301 * 77
    assert declared_pixels(b"not an image") is None
