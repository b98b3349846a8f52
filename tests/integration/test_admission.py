"""A bulk flood on the real pipeline: rt requests are still served, bulk is shed with
`overloaded` and a retry-after, and every request still gets exactly one answer."""

from __future__ import annotations

import asyncio

import pytest

from schemas.request import Lane, Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration

LONG = " ".join(["partition consumer latency model batch queue cache request encoder pipeline"] * 20)


@pytest.fixture(scope="module")
def strict_pipeline(infra):
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text",
                          MMSTREAM_ADMISSION_MAX_QUEUED_MS_BULK="150",
                          MMSTREAM_ADMISSION_REFRESH_MS="200",
                          MMSTREAM_ADMISSION_BACKPRESSURE_HIGH_MS="100000",  # test shedding, not pausing
                          MMSTREAM_CACHE_ENABLED="false",
                          MMSTREAM_ENCODER_MAX_BATCH_SIZE="4")
    yield pipe
    pipe.supervisor.stop()


async def test_bulk_flood_is_shed_while_rt_is_served(strict_pipeline):
    pipe = strict_pipeline
    async with Client(pipe.bootstrap, pipe.prefix) as client:
        # Admission prices work from what the encoders measured and reported: let them measure
        # long texts first (right after start the broker and the engines are still warming up).
        warm = [await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=f"warm {i} {LONG}"),)))
                for i in range(12)]
        await asyncio.gather(*(s.result(timeout_s=60) for s in warm))
        await asyncio.sleep(1.0)  # a load report or two (MMSTREAM_ADMISSION_REFRESH_MS is 200)
        bulk = [await client.submit(Request(id=new_id(), lane=Lane.BULK, parts=(Part(Modality.TEXT, text=f"{i} {LONG}"),)))
                for i in range(300)]
        rt = []
        for i in range(10):
            await asyncio.sleep(0.3)
            rt.append(await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=f"interactive {i}"),))))
        rt_events = await asyncio.gather(*(s.result(timeout_s=180) for s in rt))
        bulk_events = await asyncio.gather(*(s.result(timeout_s=180) for s in bulk))
    assert all(e.kind == "result" for e in rt_events), [e.error for e in rt_events if e.error]
    shed = [e for e in bulk_events if e.kind == "error"]
    assert shed, "no bulk request was shed"
    assert all(e.error["code"] == "overloaded" and e.error["retriable"] and e.error["retry_after_ms"] > 0
               for e in shed)
    served = [e for e in bulk_events if e.kind == "result"]
    print(f"\nbulk: {len(served)} served, {len(shed)} shed; rt: {len(rt_events)} served")
