"""Tenant isolation under abuse (issue 22) on the real broker and Redis: what a request can make
the pipeline do is priced before it is done and bounded per tenant.

The pipeline here is its own, with small bounds so that each is reached by a few requests: a
request's refs may name at most three photos' worth of bytes, a tenant's byte bucket holds
four (refilled at 1 byte/s, so nothing refills during the test), and the video stage decodes
at most ~13 frames of 320x240 per clip.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from aiokafka import AIOKafkaProducer

from mmstream.samples import photo, video
from schemas.codec import ERROR_HEADER, SOURCE_HEADER
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline
from tests.integration.kafka_io import read_to_end
from schemas.errors import WireError
from workers.claims import ClaimResolver, ClaimSize, ClaimSizer
from workers.image_header import HEAD_BYTES
from workers.redisconn import connect_async
from workers.video import FRAMES_MIME, chunk_frames, decode_video

pytestmark = pytest.mark.integration

PHOTO = photo("chelsea")
S = len(PHOTO)
CLAIM_TTL_S = 600


@pytest.fixture(scope="module")
def abuse(infra):
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.image": 1, "encode.video": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image,video",
                          MMSTREAM_ROUTER_COLOCATE_POOL="true",  # no text pool: the router's encoder is it
                          MMSTREAM_LIMITS_MAX_REQUEST_REF_BYTES=str(3 * S),
                          MMSTREAM_LIMITS_CLAIM_TTL_S=str(CLAIM_TTL_S),
                          MMSTREAM_QUOTA_REF_BYTES_PER_S="1", MMSTREAM_QUOTA_REF_BYTES_BURST=str(4 * S),
                          MMSTREAM_VIDEO_MAX_DECODED_PIXELS=str(13 * 320 * 240),
                          MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT="60000",
                          MMSTREAM_QUOTA_CLAIM_SWEEP_S="0")  # claims stored without expiry stay so (test_redis_isolation sweeps)
    yield pipe
    pipe.supervisor.stop()


def store(pipe, tenant: str) -> str:
    """A photo stored as the tenant's claim check the way a careless client would: no expiry."""
    key = f"mm:claim:{tenant}:{uuid.uuid4().hex}:0"
    redis.Redis.from_url(pipe.settings.redis.url).set(key, PHOTO)
    return key


async def test_refs_are_priced_at_their_stored_size_per_request_and_per_tenant(abuse):
    tenant = f"bytes{uuid.uuid4().hex[:6]}"
    key = store(abuse, tenant)
    r = redis.Redis.from_url(abuse.settings.redis.url)
    assert r.ttl(key) == -1
    refs = lambda n: tuple(Part(Modality.IMAGE, ref=f"redis:{key}", mime="image/jpeg") for _ in range(n))  # noqa: E731
    async with Client(abuse.bootstrap, abuse.prefix) as c:
        # One blob named by four parts: four blobs' worth, over the request's cap; nothing read.
        amplified = await (await c.submit(Request(id=new_id(), tenant=tenant, parts=refs(4)))).result(timeout_s=60)
        assert amplified.kind == "error" and amplified.error["code"] == "payload_too_large"
        assert amplified.error["field"] == "parts" and str(4 * S) in amplified.error["message"]
        # Sized, so its life is capped now: a claim check stored without an expiry got one.
        assert 0 < r.ttl(key) <= CLAIM_TTL_S
        within = await (await c.submit(Request(id=new_id(), tenant=tenant, parts=refs(3)))).result(timeout_s=90)
        assert within.kind == "result" and all(p["embedding"] is not None for p in within.payload["parts"])
        # Three of the four in the tenant's bucket are spent: two more are shed, with when to retry.
        shed = await (await c.submit(Request(id=new_id(), tenant=tenant, parts=refs(2)))).result(timeout_s=60)
        assert shed.kind == "error" and shed.error["code"] == "overloaded" and shed.error["retriable"]
        assert shed.error["retry_after_ms"] > 0 and "bytes per second" in shed.error["message"]
        # Another tenant's bucket is its own.
        other = f"other{uuid.uuid4().hex[:6]}"
        theirs = store(abuse, other)
        ok = await (await c.submit(Request(id=new_id(), tenant=other, parts=(
            Part(Modality.IMAGE, ref=f"redis:{theirs}", mime="image/jpeg"),)))).result(timeout_s=90)
        assert ok.kind == "result"


async def test_a_ref_that_grew_after_admission_is_not_read_whole(abuse):
    # The worker reads at most the size the router priced: a claim check overwritten with more
    # between admission and the read fails its part (never read past the price).
    tenant = f"grow{uuid.uuid4().hex[:6]}"
    key = store(abuse, tenant)
    r = redis.Redis.from_url(abuse.settings.redis.url)
    resolver = ClaimResolver(abuse.settings.redis.url, None, abuse.settings.limits.max_ref_bytes)
    assert resolver.fetch(f"redis:{key}", "parts.0.ref", tenant, priced_bytes=S) == PHOTO
    r.set(key, PHOTO * 3)
    with pytest.raises(Exception) as e:
        resolver.fetch(f"redis:{key}", "parts.0.ref", tenant, priced_bytes=S)
    assert getattr(e.value, "code", None) == "payload_too_large"


async def test_internal_media_types_and_pipeline_headers_are_refused_from_clients(abuse):
    frames = chunk_frames(decode_video(video(["chelsea"] * 2), 60, 16, 1.0).frames, 8)[0]
    async with Client(abuse.bootstrap, abuse.prefix) as c:
        forged = await (await c.submit(Request(id=new_id(), parts=(
            Part(Modality.IMAGE, data=frames, mime=FRAMES_MIME),)))).result(timeout_s=60)
    assert forged.kind == "error" and forged.error["code"] == "unsupported_media"
    assert forged.error["field"] == "parts.0.mime"
    marker = f"spoof-{uuid.uuid4().hex}".encode()
    producer = AIOKafkaProducer(bootstrap_servers=abuse.bootstrap)
    await producer.start()
    try:
        await (await producer.send(f"{abuse.prefix}.ingress.rt", b"\xc1" + marker,
                                   headers=[("x-mm-error", b"all is well"), ("x-mm-source", b"elsewhere"),
                                            ("trace-id", b"1")]))
    finally:
        await producer.stop()
    parked = []
    for _ in range(60):
        parked = [rec for rec in await read_to_end(abuse.bootstrap, f"{abuse.prefix}.dlq") if marker in (rec.value or b"")]
        if parked:
            break
        await asyncio.sleep(0.5)
    assert len(parked) == 1
    names = [n for n, _ in parked[0].headers]
    headers = dict(parked[0].headers)
    assert names.count(ERROR_HEADER) == 1 and names.count(SOURCE_HEADER) == 1
    assert headers[ERROR_HEADER].startswith(b"undecodable") and headers[SOURCE_HEADER].startswith(abuse.prefix.encode())
    assert headers["trace-id"] == b"1"


async def test_a_clip_is_decoded_no_further_than_its_pixel_bound(abuse):
    short = video(["chelsea"], seconds_each=1.0)  # 8 frames of 320x240: within the bound
    long = video(["chelsea", "coffee", "rocket", "astronaut"], seconds_each=1.0)  # 32: past it
    async with Client(abuse.bootstrap, abuse.prefix, inline_limit_bytes=10_000_000) as c:
        event = await (await c.submit(Request(id=new_id(), parts=(
            Part(Modality.VIDEO, data=short, mime="video/mp4"),
            Part(Modality.VIDEO, data=long, mime="video/mp4"))))).result(timeout_s=120)
    ok, refused = event.payload["parts"]
    assert ok["extras"]["frames_encoded"] == 1
    assert refused["error"]["code"] == "payload_too_large" and "decoded pixels" in refused["error"]["message"]


async def test_refs_are_sized_with_their_header_in_one_read_per_blob(abuse):
    tenant = f"head{uuid.uuid4().hex[:6]}"
    key = store(abuse, tenant)
    r = connect_async(abuse.settings.redis.url)
    try:
        sizer = ClaimSizer(r, None, CLAIM_TTL_S, head_bytes=HEAD_BYTES)
        refs = [(0, f"redis:{key}"), (1, f"redis:{key}"), (2, f"redis:mm:claim:{tenant}:gone:0")]
        got = await sizer.sizes(refs, tenant, heads=frozenset({0, 1}))
        bare = await sizer.sizes(refs[:1], tenant)  # no head asked for (an audio part's): none read
    finally:
        await r.aclose()
    assert got[0] == got[1] == ClaimSize(S, PHOTO[:HEAD_BYTES])  # what prices the photo's decode
    assert bare[0] == ClaimSize(S)
    assert isinstance(got[2], WireError) and got[2].field == "parts.2.ref"


async def test_a_pixel_bomb_is_priced_by_its_pixels_at_admission(abuse):
    import io

    from PIL import Image

    flat = io.BytesIO()
    Image.new("RGB", (5000, 5000)).save(flat, "PNG")  # 25 megapixels in a few dozen KB: ~400 ms to decode
    bomb = Part(Modality.IMAGE, data=flat.getvalue(), mime="image/png")
    async with Client(abuse.bootstrap, abuse.prefix) as c:
        refused = await (await c.submit(Request(id=new_id(), parts=(bomb,), deadline_ms=250))).result(timeout_s=60)
    # Priced as a thumbnail (the engine's 8 ms) it was admitted; priced by its pixels it cannot meet 250 ms.
    assert refused.kind == "error" and refused.error["code"] == "deadline_exceeded"
    assert "predicted" in refused.error["message"]
