"""What compute hands back to the stages above it, and what it reports to them.

``Encoded`` is one part's encoder output. ``Observer`` is the little that compute reports
while it runs (which engine serves and which variants it refused, how each cache lookup went); the streaming layer's
``streams.metrics.Metrics`` is one, so compute never imports the metrics it feeds.
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
