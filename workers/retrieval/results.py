"""What an index search answers with (``Hit``, ``Candidate``), the error of a full collection,
and the unit vectors every index stores: plain types the retrieval core and the bench use
without the index's internals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Hit:
    """One search result: the document, its cosine with the query (exact, in [-1, 1]) and
    the metadata it was upserted with."""

    doc_id: str
    score: float
    meta: dict = field(hash=False)


class Candidate(NamedTuple):
    """One document of a search's candidate pool: its id and its exact cosine with the query."""

    doc_id: str
    score: float


class IndexFullError(RuntimeError):
    """An upsert would take the collection past ``max_docs``."""

    code = "payload_too_large"
    retriable = False


def unit(vector: np.ndarray, dim: int, what: str = "vector") -> np.ndarray:
    """``vector`` as a float32 unit vector of shape (dim,); ValueError for a wrong shape,
    a non-finite value or a zero vector."""
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.shape != (dim,):
        raise ValueError(f"{what} must have {dim} values, got shape {np.shape(vector)}")
    norm = float(np.linalg.norm(v))
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError(f"{what} must be finite and non-zero")
    return v / norm
