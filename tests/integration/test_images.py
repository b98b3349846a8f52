"""Images through the real pipeline: labels from a real photo, broken and oversized images
failing only their own part, and the parts of one request encoding in parallel."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from schemas.request import Modality, Part, Request
from schemas.tensor import from_wire
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration

CATS = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat"}


from mmstream.samples import photo, video


def png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims a huge size (a decompression bomb's calling card)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    one_row = zlib.compress(b"\x00" + b"\x00" * 3 * 16)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", one_row) + chunk(b"IEND", b"")


async def test_a_cat_photo_is_labelled_a_cat_beside_a_text_part(pipeline):
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), parts=(
            Part(Modality.TEXT, text="what is this?"),
            Part(Modality.IMAGE, data=photo("chelsea"), mime="image/jpeg"),
            Part(Modality.IMAGE, data=photo("coffee", "PNG"), mime="image/png"))))
        event = await sub.result(timeout_s=90)
    assert event.kind == "result" and not event.payload["partial"]
    text, cat, coffee = event.payload["parts"]
    assert cat["extras"]["top5"][0][0] in CATS, cat["extras"]["top5"]
    assert any(w in coffee["extras"]["top5"][0][0] for w in ("espresso", "cup", "coffee"))
    emb = from_wire(cat["embedding"]).astype(np.float32)
    assert emb.shape == (1280,) and abs(float(np.linalg.norm(emb)) - 1.0) < 1e-2
    stages = [s["stage"] for s in event.timings["stages"]]
    assert "encode.image" in stages or "encode.text" in stages


async def test_broken_and_oversized_images_fail_only_their_own_part(pipeline):
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), parts=(
            Part(Modality.TEXT, text="the text still gets answered"),
            Part(Modality.IMAGE, data=b"\xff\xd8\xff\xe0 truncated jpeg", mime="image/jpeg"),
            Part(Modality.IMAGE, data=png_header_claiming(50_000, 50_000), mime="image/png"),
            Part(Modality.IMAGE, data=photo("chelsea"), mime="image/jpeg"))))
        event = await sub.result(timeout_s=90)
    assert event.kind == "result" and event.payload["partial"]
    text, broken, bomb, cat = event.payload["parts"]
    assert text["embedding"] is not None and cat["embedding"] is not None
    assert broken["error"]["code"] == "unsupported_media" and broken["error"]["field"] == "parts.1"
    assert bomb["error"]["code"] == "payload_too_large" and bomb["error"]["field"] == "parts.2"


@pytest.fixture(scope="module")
def image_pool(infra):
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 4},
                          MMSTREAM_KAFKA_PARTITIONS="4", MMSTREAM_ENCODER_INTRA_OP_THREADS="1")
    yield pipe
    pipe.supervisor.stop()


async def test_four_images_encode_in_parallel_on_four_workers(image_pool):
    images = [photo(n) for n in ("chelsea", "coffee", "astronaut", "rocket")]
    async with Client(image_pool.bootstrap, image_pool.prefix) as client:
        for attempt in range(3):  # the first request may meet workers still joining the group
            # A tenant of its own: cache hits (answered without the engine) would show no overlap.
            sub = await client.submit(Request(id=new_id(), tenant=f"parallel-{new_id()[:8]}", parts=tuple(
                Part(Modality.IMAGE, data=d, mime="image/jpeg") for d in images)))
            event = await sub.result(timeout_s=120)
            windows = [s for p in event.timings["parts"] for s in p["spans"] if s[0] == "encode.image"]
            if event.kind == "result" and _parallel(windows):
                break
    assert event.kind == "result" and not event.payload["partial"]
    # Each span is [stage, queued_at, started_at, finished_at] in epoch ms. With four workers
    # the four images run at the same time: together they take far less than one after another
    # (two cores, so not a quarter; each worker decodes its photo first, so starts differ).
    assert len(windows) == 4 and _parallel(windows), windows


def _parallel(windows: list) -> bool:
    wall = max(s[3] for s in windows) - min(s[2] for s in windows)
    return wall < 0.75 * sum(s[3] - s[2] for s in windows)


async def test_a_video_is_sampled_encoded_in_chunks_and_pooled(pipeline):
    clip = video(["chelsea", "coffee", "astronaut", "chelsea", "rocket"], seconds_each=1.0)
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), parts=(
            Part(Modality.VIDEO, data=clip, mime="video/mp4"),
            Part(Modality.VIDEO, data=b"\x00\x00\x00\x18ftypmp42 broken", mime="video/mp4"))))
        event = await sub.result(timeout_s=120)
    assert event.kind == "result" and event.payload["partial"]
    good, bad = event.payload["parts"]
    emb = from_wire(good["embedding"]).astype(np.float32)
    assert emb.shape == (1280,) and abs(float(np.linalg.norm(emb)) - 1.0) < 1e-2
    extras = good["extras"]
    assert extras["frames_sampled"] == 5 and extras["frames_encoded"] == 5 and extras["complete"]
    assert len(extras["frame_labels"]) == 5 and extras["frame_labels"][0] in CATS
    stages = [s[0] for s in event.timings["parts"][0]["spans"]]
    assert stages[0] == "encode.video" and "encode.image" in stages
    assert bad["error"]["code"] == "unsupported_media" and bad["error"]["field"] == "parts.1"
