"""Sample media built in the tests themselves (no downloads): photos that ship with
scikit-image, and short videos written with PyAV from them."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def photo_array(name: str) -> np.ndarray:
    from skimage import data

    return getattr(data, name)()


def photo(name: str, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photo_array(name)).save(buf, fmt)
    return buf.getvalue()


def video(names: list[str], seconds_each: float = 1.0, fps: int = 8, size: tuple[int, int] = (320, 240),
          fmt: str = "mp4", codec: str = "mpeg4") -> bytes:
    """An MP4 (or WebM) slideshow of the named photos, ``seconds_each`` per photo."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for name in names:
            img = Image.fromarray(photo_array(name)).convert("RGB").resize(size)
            for _ in range(int(seconds_each * fps)):
                for packet in stream.encode(av.VideoFrame.from_image(img)):
                    out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
