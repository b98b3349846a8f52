"""Sending a stage's outputs and waiting for the broker to take them.

A stage acknowledges its input only after its outputs are delivered, so a crash between
the two repeats work (downstream stages are idempotent) but never loses it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from schemas.codec import CONTENT_TYPE_HEADER, MSGPACK, pack
from schemas.trace import now_ms


@dataclass(frozen=True, slots=True)
class Out:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    partition: int | None = None
    """None: the producer's partitioner picks from the key."""


def out_map(topic: str, key: str | bytes, obj: dict[str, Any], partition: int | None = None) -> Out:
    """An output whose value is a MessagePack map."""
    k = key.encode() if isinstance(key, str) else key
    return Out(topic, k, pack(obj), [(CONTENT_TYPE_HEADER, MSGPACK.encode())], partition)


async def send_all(producer: Any, outs: list[Out]) -> None:
    """Send every output (in order per partition) and wait until the broker has them all.

    Raises the first send error; the caller decides what that means for its input.
    """
    ts = now_ms() / 1000.0
    pending = [await producer.send(o.topic, o.key, o.value, o.partition, ts, o.headers) for o in outs]
    if pending:
        await asyncio.gather(*pending)
