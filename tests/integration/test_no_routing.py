"""The no-routing baseline: every part on one shared topic, served by one generic pool."""

from __future__ import annotations

import pytest

from mmstream.samples import photo, video
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration


async def test_one_generic_pool_serves_every_modality(infra):
    import asyncio

    pipe = await asyncio.to_thread(start_pipeline, infra, {"router": 1, "assembler": 1, "encode.any": 1},
                                   MMSTREAM_ROUTER_MODALITY_TOPICS="false")
    try:
        async with Client(pipe.bootstrap, pipe.prefix) as client:
            sub = await client.submit(Request(id=new_id(), parts=(
                Part(Modality.TEXT, text="one queue for everything"),
                Part(Modality.IMAGE, data=photo("coffee"), mime="image/jpeg"),
                Part(Modality.VIDEO, data=video(["chelsea", "rocket"]), mime="video/mp4"))))
            event = await sub.result(timeout_s=120)
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    assert event.kind == "result" and not event.payload["partial"], event.error
    text, image, clip = event.payload["parts"]
    assert image["extras"]["top5"][0][0] == "espresso"
    assert clip["extras"]["frames_encoded"] == 2 and len(clip["extras"]["frame_labels"]) == 2
    assert {s[0] for p in event.timings["parts"] for s in p["spans"]} == {"encode.any"}
