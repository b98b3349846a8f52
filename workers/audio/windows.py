"""Whisper's 30 s windows: packing a clip's speech into them, and pooling the encoder's
output over them back into one embedding (steps 3 and 4 of ``workers.audio``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from workers.audio.decode import SAMPLE_RATE

WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's fixed 30 s input
MEL_FRAMES = 3000  # 10 ms hop
SAMPLES_PER_ENCODER_FRAME = 320  # the encoder halves the mel frames: 20 ms per output frame


def pack_windows(segments: Sequence[tuple[int, int]], window: int = WINDOW_SAMPLES) -> list[list[tuple[int, int]]]:
    """Group ``segments`` into windows of at most ``window`` samples in total, in order.

    A segment goes whole into the current window when it fits, else it starts a new one;
    a segment longer than ``window`` is cut into pieces of ``window`` samples.
    """
    windows: list[list[tuple[int, int]]] = []
    used = window  # forces a new window for the first segment
    for start, end in segments:
        while end - start > 0:
            length = end - start
            if used + length <= window:
                windows[-1].append((start, end))
                used += length
                break
            if length <= window:
                windows.append([(start, end)])
                used = length
                break
            windows.append([(start, start + window)])
            used = window
            start += window
    return windows


def pooled_embedding(encoded: Sequence[np.ndarray], speech_samples: Sequence[int]) -> np.ndarray:
    """Mean of the encoder frames that hold speech over all of a clip's windows, L2-normalized.

    ``encoded[i]`` is window i's encoder output [frames, dim]; ``speech_samples[i]`` how many
    of its samples are speech (they come first, the rest is padding).
    """
    total = None
    count = 0
    for frames, n in zip(encoded, speech_samples):
        used = min(len(frames), max(1, math.ceil(n / SAMPLES_PER_ENCODER_FRAME)))
        part = frames[:used].astype(np.float64).sum(axis=0)
        total = part if total is None else total + part
        count += used
    if total is None:
        raise ValueError("no windows to pool")
    mean = total / count
    norm = float(np.linalg.norm(mean))
    return (mean / norm if norm > 0 else mean).astype(np.float32)
