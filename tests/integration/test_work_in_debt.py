"""Work admitted over its tenant's compute bucket (in debt) runs below everyone else's, in the
encoder pools as in the generator (test_generate.py): the real broker, Redis, image model and
worker processes, the priority read from the kernel and the pool's own metrics."""

from __future__ import annotations

import asyncio
import io
import os

import pytest

from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline
from tests.integration.test_metrics_live import scrape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def debt_pipeline(infra):
    # A compute quota that refills at once (100 s a second) and holds 3 s: a request priced over
    # 3 s is admitted in debt, anything smaller is ordinary.
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image",
                          MMSTREAM_QUOTA_COMPUTE_MS_PER_S="100000", MMSTREAM_QUOTA_COMPUTE_BURST_MS="3000")
    yield pipe
    pipe.supervisor.stop()


def _flat_png(side: int, shade: int) -> bytes:
    """A ``side`` x ``side`` PNG of one colour: priced by its pixels (the decode), a few dozen KB."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (shade, 90, 30)).save(buf, "PNG", compress_level=9)
    return buf.getvalue()


def _lowered(port: int) -> float:
    return sum(s.value for s in scrape(port).get("mmstream_cpu_lowered", [])
               if s.name.endswith("_total") and s.labels.get("stage") == "encode.image")


async def _embed(client: Client, *images: bytes):
    sub = await client.submit(Request(id=new_id(), deadline_ms=120_000,
                                      parts=tuple(Part(Modality.IMAGE, data=d, mime="image/png") for d in images)))
    return await sub.result(timeout_s=120)


async def test_a_request_admitted_in_debt_runs_the_image_pool_lower_and_an_ordinary_one_does_not(debt_pipeline):
    [pool] = [w for w in debt_pipeline.supervisor.workers() if w.stage == "encode.image"]
    async with Client(debt_pipeline.bootstrap, debt_pipeline.prefix) as client:
        # 2,000 px: priced ~60 ms, over what the router's own image encoder takes: the pool's.
        ordinary = await _embed(client, _flat_png(2000, 7))
        assert ordinary.kind == "result", ordinary
        assert _lowered(pool.metrics_port) == 0
        # Sixteen 4,000 px pictures: ~250 ms each to decode, ~4 s in all, over the 3 s bucket.
        heavy = await _embed(client, *(_flat_png(4000, shade) for shade in range(16)))
        assert heavy.kind == "result", heavy
    assert _lowered(pool.metrics_port) >= 1
    for _ in range(100):  # back at its level once that batch is answered
        if os.getpriority(os.PRIO_PROCESS, pool.pid) == 0:
            break
        await asyncio.sleep(0.05)
    assert os.getpriority(os.PRIO_PROCESS, pool.pid) == 0
