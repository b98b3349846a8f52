"""Texts to unit vectors with the text encoder the pipeline serves: the same ``EncoderFront``
an ``encode.text`` worker drives (same model, version, precision and preprocessing, and the
same Redis reuse cache), called in this process. The indexing stage embeds documents with it
and the retrieve stage embeds the question of a retrieval-augmented generate request, so a
document, a query from the encoder pool and a RAG question share one vector space.

Documents longer than the model's input are embedded from their first tokens only (MiniLM
reads 128): the text the passage gives a prompt is the whole document all the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.jobs import EncodeJob
from workers.outputs import Encoded, EncoderRunner, Prepared


class TextEmbedder:
    """``embed(texts, tenant)``: per text its float32 unit vector, or the exception that
    refused it (one bad text never fails the others). Not thread-safe: one thread calls it."""

    def __init__(self, front: EncoderRunner) -> None:
        self.front = front
        self.identity: str = front.identity
        """name/version/precision/preprocessing: which vector space the outputs live in."""

    def embed(self, texts: list[str], tenant: str) -> list[np.ndarray | Exception]:
        jobs = [EncodeJob(id=f"embed-{i}", part=0, n_parts=1, modality="text", lane="bulk", tenant=tenant,
                          deadline_at_ms=float("inf"), sent_at_ms=0.0, text=t) for i, t in enumerate(texts)]
        items = self.front.prepare_many(jobs)
        todo = [i for i, it in enumerate(items) if isinstance(it, Prepared)]
        out: list[Any] = list(items)
        if todo:
            ran = self.front.run([items[i] for i in todo])
            writes = []
            for i, r in zip(todo, ran):
                out[i] = r
                if isinstance(r, Encoded) and items[i].key is not None:
                    writes.append((items[i].key, r))
            if writes:
                self.front.store(writes)
        return [_unit(r) if isinstance(r, Encoded) else (r if isinstance(r, Exception) else
                ValueError(f"unexpected encoder output {type(r).__name__}")) for r in out]


def _unit(e: Encoded) -> np.ndarray:
    v = np.asarray(e.embedding, dtype=np.float32).reshape(-1)
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v
