"""Pooling the chunk results of a fanned-out part (a video's frame chunks) into one part.

Each chunk result carries the SUM of its frames' unit embeddings (float32 on the wire) and
``extras.frames`` / ``extras.labels``; the pooled embedding is the mean over all frames,
L2-normalized, so chunking never changes the answer. Pure: plain data in and out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.jobs import EncodedPart
from schemas.tensor import from_wire, to_wire


def pool_chunks(header: EncodedPart, chunks: dict[int, EncodedPart], complete: bool) -> EncodedPart:
    """One part from its header and the chunk results that arrived (``complete``: all of them)."""
    # Frame chunks come from the image pool; a soundtrack chunk (from the audio pool) adds
    # its transcript but not its embedding (another model's space).
    tracks = [c for c in chunks.values() if c.modality == "audio"]
    chunks = {k: c for k, c in chunks.items() if c.modality != "audio"}
    ok = [chunks[k] for k in sorted(chunks) if chunks[k].error is None and chunks[k].embedding is not None]
    last = max(chunks.values(), key=lambda c: c.sent_at_ms) if chunks else header
    trace = list(header.trace) + [s for s in last.trace if s not in header.trace]
    if not ok:
        failed = next((c.error for c in chunks.values() if c.error), None)
        error = failed or {"code": "deadline_exceeded", "message": "no frame chunk was encoded before the deadline",
                           "field": f"parts.{header.part}", "retriable": True, "retry_after_ms": 0}
        return EncodedPart(id=header.id, part=header.part, modality=header.modality, sent_at_ms=last.sent_at_ms,
                           error=error, extras=dict(header.extras), trace=trace, tenant=header.tenant,
                           nonce=header.nonce)
    total = sum((from_wire(c.embedding).astype(np.float64) for c in ok), np.zeros(1))
    frames = sum(int(c.extras.get("frames", 1)) for c in ok)
    norm = float(np.linalg.norm(total))
    pooled = (total / norm if norm > 0 else total).astype(np.float32)
    extras: dict[str, Any] = dict(header.extras)
    for track in tracks:
        if track.error is not None:
            extras["audio_error"] = track.error
        else:
            extras.update(transcript=track.extras.get("transcript", ""),
                          speech_seconds=track.extras.get("speech_seconds"))
    fps = float(header.extras.get("fps") or 1.0)
    tops = [top for c in ok for top in c.extras.get("top", [])]
    extras.update(frames_encoded=frames, complete=complete and len(ok) + len(tracks) == header.n_chunks,
                  frame_labels=[label for c in ok for label in c.extras.get("labels", [])],
                  frame_top=[[round(i / fps, 3), top] for i, top in enumerate(tops)])
    spaces = {c.space for c in ok}  # the frames' encoder: a pooled video searches image documents
    return EncodedPart(id=header.id, part=header.part, modality=header.modality, sent_at_ms=last.sent_at_ms,
                       embedding=to_wire(pooled, "float16"), extras=extras, trace=trace, tenant=header.tenant,
                       nonce=header.nonce, space=spaces.pop() if len(spaces) == 1 else None)
