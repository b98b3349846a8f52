"""Documents written to a collection while a chaos scenario's faults fire, and the check that
the retrieve stage's index ends equal to the collection topic (issue 23: "kill the indexing
and retrieve stages during ingest: nothing lost, the index equals the topic").

A scenario asks for it with ``"documents": {"collection": "kb", "count": 60, "rate": 6}``:
``count`` passages are put at ``rate`` per second (open loop, seeded), then a third of them
rewritten and another third deleted. The topic's last record per id is the collection the
index must hold: every live id with its latest text, and no deleted one. The check searches
with ``k`` = the live count (at most ``retrieval.max_k``, so ``count`` is bounded) until the
answer holds that many documents and exactly those ids and texts, or ``timeout_s`` passes.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from streams.sdk.client import Client

MAX_LIVE = 50
"""The most live documents a check can see in one answer (``retrieval.max_k``'s default)."""


@dataclass(frozen=True)
class Ingest:
    collection: str
    count: int
    rate: float
    seed: int = 1

    @classmethod
    def parse(cls, raw: dict[str, Any], seed: int) -> "Ingest":
        spec = cls(str(raw.get("collection", "kb")), int(raw.get("count", 60)), float(raw.get("rate", 6.0)), seed)
        if not (3 <= spec.count and spec.count - spec.count // 3 <= MAX_LIVE and spec.rate > 0):
            raise ValueError(f"documents: count 3-{MAX_LIVE * 3 // 2} (two thirds stay live) and a rate > 0")
        return spec


def plan(spec: Ingest) -> list[tuple[str, str | None]]:
    """(doc id, text or None for a delete) in the order they are written."""
    rng = random.Random(spec.seed)
    ids = [f"d{i:03d}" for i in range(spec.count)]
    ops: list[tuple[str, str | None]] = [(d, f"Passage {d} about topic {rng.randrange(7)}.") for d in ids]
    shuffled = rng.sample(ids, len(ids))
    third = len(ids) // 3
    ops += [(d, f"Rewritten passage {d}.") for d in shuffled[:third]]
    ops += [(d, None) for d in shuffled[third:2 * third]]
    return ops


def live(ops: list[tuple[str, str | None]]) -> dict[str, str]:
    """What the compacted topic holds after ``ops``: the last text per id, deletes gone."""
    out: dict[str, str] = {}
    for doc, text in ops:
        if text is None:
            out.pop(doc, None)
        else:
            out[doc] = text
    return out


WRITE_GIVE_UP_S = 120.0


async def write(client: Client, spec: Ingest, started: float) -> dict[str, str]:
    """Write the plan at ``spec.rate`` from ``started`` (time.monotonic()); returns the live set.
    A write that fails (the broker away) is retried until it is with the broker (the topic,
    not what was tried, is what the index must equal), for at most ``WRITE_GIVE_UP_S``; then
    it raises, and the run fails."""
    ops = plan(spec)
    for i, (doc, text) in enumerate(ops):
        delay = started + i / spec.rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        deadline = time.monotonic() + WRITE_GIVE_UP_S
        while True:
            try:
                if text is None:
                    await client.delete_document(spec.collection, doc)
                else:
                    await client.put_document(spec.collection, doc, text, {"n": i})
                break
            except Exception:  # noqa: BLE001 - a fault in progress; the write must land
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    return live(ops)


async def check(client: Client, spec: Ingest, want: dict[str, str], timeout_s: float) -> tuple[list[str], str]:
    """(violations, what was found): no violation when a search answers with exactly ``want``
    (ids and texts) before ``timeout_s``; otherwise what the last answer held."""
    started = time.monotonic()
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            sub = await client.retrieve(spec.collection, "passage about a topic", k=len(want), deadline_ms=30_000)
            ev = await sub.result(timeout_s=40)
        except Exception as exc:  # noqa: BLE001 - keep asking until the deadline
            last = f"no answer: {exc!r}"
            await asyncio.sleep(1.0)
            continue
        if ev.kind == "result":
            payload = ev.payload or {}
            got = {h["id"]: h["text"] for h in payload.get("hits", [])}
            documents = (payload.get("index") or {}).get("documents")
            if got == want and documents == len(want):
                return [], (f"the index equals the topic: {len(want)} live documents of {spec.count}, "
                            f"after {time.monotonic() - started:.1f}s")
            extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            stale = sorted(d for d in set(got) & set(want) if got[d] != want[d])
            last = (f"the index holds {documents} documents, the topic {len(want)}: extra {extra[:5]}, "
                    f"missing {missing[:5]}, stale text {stale[:5]}")
        else:
            last = f"error {(ev.error or {}).get('code')}"
        await asyncio.sleep(1.0)
    return [f"index not equal to the collection topic after {timeout_s:.0f}s: {last}"], last
