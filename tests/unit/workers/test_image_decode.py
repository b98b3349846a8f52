"""decode_image: the formats served, the pixel-count guard before decoding, clear refusals."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from schemas.errors import ErrorCode, WireError
from workers.image import decode_image

LIMIT = 40_000_000


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def photo_like(width: int = 320, height: int = 240, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: compresses like a photo, not like a flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return Image.fromarray(np.clip(rgb + rng.normal(0, 8, rgb.shape), 0, 255).astype(np.uint8))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG claiming ``width`` x ``height`` whose pixel data is one compressed row: anything
    that tried to decode it would fail, so a size refusal proves the guard ran first."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    row = zlib.compress(b"\x00" * (1 + 3 * min(width, 1000)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


def refused(data: bytes, mime: str | None = None, max_pixels: int = LIMIT) -> WireError:
    with pytest.raises(WireError) as info:
        decode_image(data, mime, max_pixels)
    return info.value


@pytest.mark.parametrize("fmt, mime", [("JPEG", "image/jpeg"), ("PNG", "image/png"), ("WEBP", "image/webp")])
def test_supported_formats_decode_to_rgb(fmt: str, mime: str) -> None:
    image = decode_image(encode(photo_like(), fmt), mime, LIMIT)
    assert image.mode == "RGB" and image.size == (320, 240)


def test_webp_lossless_round_trips_exactly() -> None:
    source = photo_like(64, 48)
    decoded = decode_image(encode(source, "WEBP", lossless=True), "image/webp", LIMIT)
    assert np.array_equal(np.asarray(decoded), np.asarray(source))


def test_the_bytes_decide_the_decoder_not_the_declared_type() -> None:
    assert decode_image(encode(photo_like(), "PNG"), "image/jpeg", LIMIT).size == (320, 240)
    assert decode_image(encode(photo_like(), "PNG"), None, LIMIT).size == (320, 240)
    assert decode_image(encode(photo_like(), "JPEG"), "IMAGE/JPEG; q=1", LIMIT).size == (320, 240)


def test_a_huge_png_header_is_refused_before_decoding() -> None:
    error = refused(png_header_only(50_000, 50_000))
    assert error.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert "2500000000" in error.message
    assert not error.retriable


def test_our_limit_applies_below_pillows_own() -> None:
    error = refused(png_header_only(5_000, 5_000), max_pixels=1_000_000)
    assert error.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert "5000x5000" in error.message and "1000000" in error.message
    # Within the limit the same bytes reach the decoder, which finds the data truncated.
    assert refused(png_header_only(5_000, 5_000), max_pixels=LIMIT).code is ErrorCode.UNSUPPORTED_MEDIA


def test_an_image_at_the_limit_is_accepted() -> None:
    assert decode_image(encode(photo_like(100, 50), "PNG"), None, max_pixels=5_000).size == (100, 50)
    assert refused(encode(photo_like(100, 50), "PNG"), max_pixels=4_999).code is ErrorCode.PAYLOAD_TOO_LARGE


def test_random_bytes_are_unsupported_media() -> None:
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    error = refused(data)
    assert error.code is ErrorCode.UNSUPPORTED_MEDIA
    assert "unknown content" in error.message and "image/png" in error.message


def test_empty_data_is_unsupported_media() -> None:
    assert "empty" in refused(b"").message


@pytest.mark.parametrize("fmt, name", [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_other_image_formats_are_named_in_the_refusal(fmt: str, name: str) -> None:
    error = refused(encode(photo_like(32, 32), fmt))
    assert error.code is ErrorCode.UNSUPPORTED_MEDIA
    assert f"found {name}" in error.message


def test_a_refused_declared_type_is_unsupported_media() -> None:
    error = refused(encode(photo_like(), "PNG"), mime="image/gif")
    assert error.code is ErrorCode.UNSUPPORTED_MEDIA and "image/gif" in error.message


def test_a_truncated_jpeg_is_unsupported_media() -> None:
    data = encode(photo_like(), "JPEG", quality=90)
    error = refused(data[: len(data) // 2])
    assert error.code is ErrorCode.UNSUPPORTED_MEDIA
    assert "JPEG" in error.message and "truncated" in error.message


def test_a_truncated_png_is_unsupported_media() -> None:
    data = encode(photo_like(), "PNG")
    assert refused(data[: len(data) // 2]).code is ErrorCode.UNSUPPORTED_MEDIA


def test_transparent_pixels_become_white() -> None:
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # red, fully transparent
    rgba.putpixel((0, 0), (0, 0, 255, 255))  # one opaque blue pixel
    decoded = np.asarray(decode_image(encode(rgba, "PNG"), "image/png", LIMIT))
    assert tuple(decoded[0, 0]) == (0, 0, 255)
    assert tuple(decoded[4, 4]) == (255, 255, 255)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = encode(photo_like(320, 240), "JPEG", exif=exif.tobytes())
    assert decode_image(data, "image/jpeg", LIMIT).size == (240, 320)


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    grey = Image.fromarray(np.full((16, 16), 32768, dtype=np.uint16))
    decoded = np.asarray(decode_image(encode(grey, "PNG"), "image/png", LIMIT))
    assert decoded.shape == (16, 16, 3) and 120 <= decoded[0, 0, 0] <= 135


def test_jpeg_may_be_decoded_at_reduced_scale_above_the_target() -> None:
    data = encode(photo_like(1024, 768), "JPEG", quality=90)
    full = decode_image(data, "image/jpeg", LIMIT)
    reduced = decode_image(data, "image/jpeg", LIMIT, min_shorter_side=256)
    assert full.size == (1024, 768)
    assert min(reduced.size) >= 256 and reduced.size[0] < 1024
    # A PNG has no reduced decode: same pixels either way.
    png = encode(photo_like(600, 400), "PNG")
    assert decode_image(png, None, LIMIT, min_shorter_side=256).size == (600, 400)


def test_the_same_picture_normalizes_to_the_same_pixels_whatever_its_encoding():
    from workers.image import normalized_pixels

    img = photo_like(400, 300, seed=3)
    png, webp = encode(img, "PNG"), encode(img, "WEBP", lossless=True)
    assert png != webp
    assert normalized_pixels(png, "image/png", 10**8) == normalized_pixels(webp, "image/webp", 10**8)
    assert normalized_pixels(b"not an image", None, 10**8) is None
