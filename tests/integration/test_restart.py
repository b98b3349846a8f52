"""Worker crashes and restarts mid-run: every request still gets exactly one terminal event."""

from __future__ import annotations

import asyncio
import signal

import pytest

from schemas.request import Modality, Part, Request
from streams.client import Client, new_id
from tests.integration.kafka_io import terminal_events

pytestmark = pytest.mark.integration


async def test_encoder_killed_and_router_restarted_mid_run(pipeline):
    sup = pipeline.supervisor
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        subs = []
        for i in range(120):
            subs.append(await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=f"request {i}"),),
                                                    deadline_ms=120_000)))
            if i == 30:
                enc = next(w for w in sup.workers() if w.stage == "encode.text")
                await asyncio.to_thread(sup.stop_one, enc, 5.0, signal.SIGKILL)
                await asyncio.to_thread(sup.start, {"encode.text": 1})
            if i == 70:
                router = next(w for w in sup.workers() if w.stage == "router")
                await asyncio.to_thread(sup.stop_one, router, 30.0, signal.SIGTERM)
                await asyncio.to_thread(sup.start, {"router": 1})
            await asyncio.sleep(0.02)
        events = await asyncio.gather(*(s.result(timeout_s=150) for s in subs))
    assert all(e.kind == "result" for e in events)
    on_wire = await terminal_events(pipeline.bootstrap, f"{pipeline.prefix}.results", {s.id for s in subs})
    counts = {rid: len(evs) for rid, evs in on_wire.items()}
    assert len(counts) == 120 and set(counts.values()) == {1}, counts
