"""Documents to unit vectors with an encoder the pipeline serves: the same ``EncoderFront``
an ``encode.<modality>`` worker drives (same model, version, precision and preprocessing, and
the same Redis reuse cache), called in this process. The indexing stage embeds passages with
the text encoder's and images with the image encoder's; the retrieve stage embeds the
question of a retrieval-augmented generate request with the text encoder's. So a document,
a query from the encoder pool and a RAG question of one modality share one vector space,
named by the encoder's ``identity``.

Documents longer than the model's input are embedded from their first tokens only (MiniLM
reads 128): the text the passage gives a prompt is the whole document all the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.documents import Document
from schemas.jobs import EncodeJob
from workers.outputs import Encoded, EncoderRunner, Prepared


class Embedder:
    """``embed(items, tenant)``: per item (a text, or for the image encoder a ``Document``
    with its image bytes or ref) its float32 unit vector, or the exception that refused it
    (one bad item never fails the others). Not thread-safe: one thread calls it."""

    def __init__(self, front: EncoderRunner, modality: str = "text", max_ref_bytes: int | None = None) -> None:
        self.front = front
        self.modality = modality
        self.max_ref_bytes = max_ref_bytes
        """A ref is read at most this far, and refused past it (None: the claim resolver's own bound)."""
        self.identity: str = front.identity
        """name/version/precision/preprocessing: which vector space the outputs live in."""

    def _job(self, i: int, item: str | Document, tenant: str) -> EncodeJob:
        base = dict(id=f"embed-{i}", part=0, n_parts=1, modality=self.modality, lane="bulk", tenant=tenant,
                    deadline_at_ms=float("inf"), sent_at_ms=0.0)
        if isinstance(item, str):
            return EncodeJob(**base, text=item)
        if self.modality == "text":
            return EncodeJob(**base, text=item.text)
        return EncodeJob(**base, data=item.image, ref=item.ref, mime=item.mime,
                         ref_bytes=self.max_ref_bytes if item.ref is not None else None)

    def embed(self, items: list[str] | list[Document], tenant: str) -> list[np.ndarray | Exception]:
        jobs = [self._job(i, t, tenant) for i, t in enumerate(items)]
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
