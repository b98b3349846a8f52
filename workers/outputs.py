"""What compute hands back to the stages above it, and what it reports to them.

``Encoded`` is one part's encoder output. ``Observer`` is the little that compute reports
while it runs (which engine serves and which variants it refused, how each cache lookup went); the streaming layer's
``streams.observe.metrics.Metrics`` is one, so compute never imports the metrics it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Encoded:
    """One part's encoder output: its embedding and what users want beside it."""

    embedding: np.ndarray
    extras: dict[str, Any]
    cache: str | None = None
    """'hit' or 'miss' when the reuse cache was consulted for this part."""


class Observer(Protocol):
    """Where compute reports what it serves and how its cache did."""

    def set_engine(self, stage: str, info: Mapping[str, str]) -> None:
        """The engine ``stage`` serves with (model, version, precision, provider, backend)."""

    def cache_lookup(self, modality: str, result: str) -> None:
        """One reuse-cache lookup of ``modality``: ``hit``, ``miss`` or ``error``."""

    def engine_fallback(self, stage: str, from_: str, to: str, reason: str) -> None:
        """``stage`` refused engine variant ``from_`` and went on to ``to`` (``workers.engines.gate``)."""

@dataclass(frozen=True, slots=True)
class Prepared:
    """One job after the CPU work that comes before the model (bytes fetched, decoded,
    tokenized): what the engine thread batches."""

    job: Any
    """The ``schemas.jobs.EncodeJob`` it came from."""
    length: float
    """Its cost units: tokens for text (the batch pads to the longest), frames for a frame
    chunk, 1 for one image or clip."""
    data: Any
    """What the modality's ``run`` needs: token ids, a pixel array, decoded samples."""
    content: bytes | None = None
    """The bytes its cache key hashes, when preparing already produced them (else the
    modality's own ``cache_content`` is asked)."""
    key: str | None = None
    """Its reuse-cache key (None: not cached); set by ``workers.encoders.EncoderFront``."""


class EncoderRunner(Protocol):
    """What an encode stage drives (``workers.encoders.EncoderFront`` is the one). Every
    method but the attributes runs in a worker thread, never on the event loop."""

    identity: str
    variable_length: bool
    cost_prior: tuple[float, float, float]
    rows_alone: bool

    def prepare_many(self, jobs: list[Any]) -> list[Any]:
        """Per job: its exception, an ``Encoded`` (a cache hit), or its ``Prepared`` (``key`` set when cached)."""

    def prepare_items(self, jobs: list[Any], heavy: bool = False) -> list[Any]:
        """``prepare_many`` without the reuse cache: per job its exception or its ``Prepared``
        (``heavy``: jobs priced as heavy, prepared where the modality puts those)."""

    def lookup(self, prepared: list[Any], wait_for_others: bool = True) -> list[Any]:
        """The reuse cache's half of ``prepare_many``: ``prepared`` with hits in place of their
        items; a miss another worker is computing is waited for only with ``wait_for_others``."""

    def run(self, items: list[Prepared]) -> list[Any]:
        """One ``Encoded`` or exception per item, in order (the engine call)."""

    def store(self, writes: list[tuple[str, Encoded]]) -> None:
        """Put computed outputs in the reuse cache (best effort)."""

    def calibrate(self) -> list[tuple[int, float, float]]:
        """(rows, length, ms) of batches timed on the engine at start-up."""
