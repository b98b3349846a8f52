"""Fidelity measurement: how far a variant's outputs drift from its reference.

The sentence list is fixed (changing it changes the recorded numbers; the build key sees
this module's code, so a change rebuilds every model). It mixes lengths from one word
to past 100 tokens, questions, code, numbers, non-English text and emoji, because int8
error is not uniform: short and unusual inputs drift most.
"""

from __future__ import annotations

import numpy as np

FIDELITY_SENTENCES: tuple[str, ...] = (
    "hi",
    "Kafka",
    "The cat sat on the mat.",
    "A dog is running through the park with a ball in its mouth.",
    "How do I reset my password if I no longer have access to my email?",
    "What is the capital of Australia?",
    "Canberra is the capital city of Australia.",
    "The quarterly revenue grew by 12.5% to $4.2 billion, beating analyst estimates.",
    "Please deliver the package to 221B Baker Street before 5 pm on Friday.",
    "def add(a, b):\n    return a + b",
    "SELECT name, count(*) FROM orders GROUP BY name HAVING count(*) > 10;",
    "Error: connection refused (errno 111) while contacting 10.0.0.12:9092",
    "I absolutely loved this film; the soundtrack alone is worth the ticket.",
    "This was the worst customer service experience I have ever had.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The mitochondria is the powerhouse of the cell.",
    "Le chat dort sur le canapé depuis ce matin.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "¿Dónde está la estación de tren más cercana?",
    "Great job team!!! 🎉🎉🎉",
    "lol ok see u tmrw",
    "1 2 3 4 5 6 7 8 9 10",
    "https://example.com/path?query=value&other=123",
    "The patient presented with acute chest pain radiating to the left arm.",
    "Under the terms of this agreement, the licensee shall not sublicense the software.",
    "Stir the sauce continuously over low heat until it thickens, about ten minutes.",
    "A transformer encoder maps a sequence of token embeddings to contextual "
    "representations using stacked self-attention and feed-forward layers.",
    "Streams of requests arrive on per-modality topics; the router validates each one, "
    "estimates its cost, admits or defers it, checks the cache, and splits multimodal "
    "requests into parts that encode in parallel on separately scaled worker pools, "
    "after which the assembler gathers the parts by request id before the deadline.",
    "When the river flooded in the spring, the villagers moved their animals to the hills, "
    "stacked sandbags along the mill road, and took turns watching the water through the "
    "night; by morning the level had dropped, the bridge still stood, and the only real "
    "loss was a cart that someone had forgotten to pull back from the bank, which the "
    "children later found tangled in the reeds two miles downstream.",
)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of ``a`` with the same row of ``b`` (float64, [rows])."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-30)


def compare(candidate: np.ndarray, reference: np.ndarray, reference_name: str) -> dict[str, float | str | int]:
    """Fidelity of ``candidate`` rows against ``reference`` rows, as config.json stores it."""
    cos = cosine_rows(candidate, reference)
    return {
        "reference": reference_name,
        "samples": int(len(cos)),
        "mean_cosine": round(float(cos.mean()), 7),
        "min_cosine": round(float(cos.min()), 7),
        "max_abs_diff": float(np.abs(np.asarray(candidate) - np.asarray(reference)).max()),
    }
