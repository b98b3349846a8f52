"""Observed engine cost per unit of work, shared through Redis so the router's admission
and routing follow what the encoders really take (instead of fixed guesses).

Each encoder pool keeps an EWMA of milliseconds per unit (tokens for text, images or frames
for the image pool, clips for audio) over its batches, and publishes it every few seconds
into the hash ``mm:cost:<prefix>``; the router reads the hash when it refreshes its load
view. Both sides are best effort: Redis down only means the last (or default) numbers stay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def cost_key(topic_prefix: str) -> str:
    return f"mm:cost:{topic_prefix}"


@dataclass
class CostObserver:
    """EWMA of ms per unit for one modality (pure; the encoder feeds it after each batch)."""

    alpha: float = 0.2
    ms_per_unit: float | None = None

    def observe(self, units: float, service_ms: float) -> None:
        if units <= 0 or service_ms < 0:
            return
        seen = service_ms / units
        self.ms_per_unit = seen if self.ms_per_unit is None else (1 - self.alpha) * self.ms_per_unit + self.alpha * seen


async def publish(redis: Any, topic_prefix: str, modality: str, observer: CostObserver) -> None:
    if observer.ms_per_unit is None:
        return
    await _hset(redis, cost_key(topic_prefix), modality, f"{observer.ms_per_unit:.6f}")


async def read(redis: Any, topic_prefix: str) -> dict[str, float]:
    """modality -> ms per unit as published; {} when Redis cannot be read."""
    out = {}
    for k, v in (await _hgetall(redis, cost_key(topic_prefix))).items():
        try:
            out[_text(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def models_key(topic_prefix: str) -> str:
    return f"mm:models:{topic_prefix}"


async def publish_identity(redis: Any, topic_prefix: str, modality: str, identity: str) -> None:
    """Which model (name/version/precision/preprocessing) answers ``modality``: part of the
    whole-result cache key, so a new model never serves an old model's answers."""
    await _hset(redis, models_key(topic_prefix), modality, identity)


async def read_identities(redis: Any, topic_prefix: str) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in (await _hgetall(redis, models_key(topic_prefix))).items()}


async def _hset(redis: Any, key: str, field: str, value: str) -> None:
    """Best effort: Redis trouble only means the readers keep their last numbers."""
    try:
        await redis.hset(key, field, value)
    except Exception as exc:
        log.debug("publishing %s failed: %r", key, exc)


async def _hgetall(redis: Any, key: str) -> dict[Any, Any]:
    try:
        return await redis.hgetall(key)
    except Exception as exc:
        log.debug("reading %s failed: %r", key, exc)
        return {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
