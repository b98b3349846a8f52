"""Reading topics directly, to check what is on the wire (not what the SDK deduplicates)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from schemas.codec import unpack
from schemas.events import Event
from streams.observe.topic_reader import read_to_end

__all__ = ["read_to_end", "terminal_events"]


async def terminal_events(bootstrap: str, topic: str, ids: set[str], timeout_s: float = 90.0,
                          settle_s: float = 2.0) -> dict[str, list[Event]]:
    """Terminal events per id on the wire. Waits until every id has one (or the timeout),
    then ``settle_s`` more, so that a duplicate sent shortly after is seen too."""

    def collect(records: list) -> dict[str, list[Event]]:
        found: dict[str, list[Event]] = defaultdict(list)
        for r in records:
            ev = Event.from_wire(unpack(r.value))
            if ev.terminal and ev.id in ids:
                found[ev.id].append(ev)
        return found

    deadline = time.monotonic() + timeout_s
    found = collect(await read_to_end(bootstrap, topic))
    while not ids <= set(found) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        found = collect(await read_to_end(bootstrap, topic))
    await asyncio.sleep(settle_s)
    return dict(collect(await read_to_end(bootstrap, topic)))
