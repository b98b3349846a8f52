"""Sample media made on the spot (no downloads), for the demo, the bench and the tests:
photos that ship with scikit-image, short videos written with PyAV from them, and speech
synthesized by espeak-ng. scikit-image comes with the test and build extras."""

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
          fmt: str = "mp4", codec: str = "mpeg4", soundtrack: bytes | None = None, tag: int | None = None) -> bytes:
    """An MP4 (or WebM) slideshow of the named photos, ``seconds_each`` per photo; with
    ``soundtrack`` (a WAV), that sound as an AAC audio track; with ``tag``, a small pattern
    of its bits in a corner, so clips of the same photos are different bytes."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if soundtrack is not None:
            _mux_sound(out, soundtrack)
        for name in names:
            img = Image.fromarray(photo_array(name)).convert("RGB").resize(size)
            if tag is not None:
                pixels = np.asarray(img).copy()
                for bit in range(32):
                    pixels[(bit // 8) * 4:(bit // 8) * 4 + 4, (bit % 8) * 4:(bit % 8) * 4 + 4] = 255 * ((tag >> bit) & 1)
                img = Image.fromarray(pixels)
            for _ in range(int(seconds_each * fps)):
                for packet in stream.encode(av.VideoFrame.from_image(img)):
                    out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _mux_sound(out, wav: bytes) -> None:
    import wave

    import av

    with wave.open(io.BytesIO(wav)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2" if width == 2 else "u1")
    samples = pcm.reshape(-1, channels).mean(axis=1).astype(np.float32) / (32768.0 if width == 2 else 128.0)
    track = out.add_stream("aac", rate=rate)
    track.layout = "mono"
    track.bit_rate = 128_000
    step = 1024
    for i in range(0, len(samples), step):
        frame = av.AudioFrame.from_ndarray(samples[None, i:i + step].copy(), format="fltp", layout="mono")
        frame.sample_rate = rate
        frame.pts = i
        for packet in track.encode(frame):
            out.mux(packet)
    for packet in track.encode():
        out.mux(packet)


def speech(text: str) -> bytes | None:
    """A WAV of ``text`` spoken by espeak-ng, or None where espeak-ng is not installed."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-w", str(out), text], check=True, capture_output=True)
        return out.read_bytes()
