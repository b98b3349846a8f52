"""The Redis reuse cache on the real pipeline: a hit gives exactly the miss's embedding,
and with Redis gone mid-run every request still succeeds (the cache only costs time)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import pytest

from mmstream.samples import photo
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from workers.cache import EncoderCache
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration


async def _ask(client, *parts, tenant="default"):
    sub = await client.submit(Request(id=new_id(), parts=tuple(parts), tenant=tenant))
    return await sub.result(timeout_s=60)


async def test_a_hit_returns_the_same_embedding_as_the_miss(pipeline):
    text = f"cache me {new_id()}"
    image = photo("chelsea")
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        first = await _ask(client, Part(Modality.TEXT, text=text), Part(Modality.IMAGE, data=image, mime="image/jpeg"))
        # A third part makes it another request (not a whole-result hit), so its first two
        # parts show the encoders' cache at work.
        second = await _ask(client, Part(Modality.TEXT, text=f"  {text} "), Part(Modality.IMAGE, data=image, mime="image/jpeg"),
                            Part(Modality.TEXT, text=f"another {new_id()}"))
        other_tenant = await _ask(client, Part(Modality.TEXT, text=text), tenant="someone-else")
    # The image may already be cached by an earlier test; the fresh text cannot be.
    assert first.payload["parts"][0]["cache"] == "miss"
    assert [p["cache"] for p in second.payload["parts"]] == ["hit", "hit", "miss"]
    for a, b in zip(first.payload["parts"], second.payload["parts"][:2]):
        assert a["embedding"] == b["embedding"] and a["extras"] == b["extras"]
    assert second.cache == {"hits": 2, "misses": 1}
    assert other_tenant.payload["parts"][0]["cache"] == "miss"  # tenants do not share by default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def own_redis():
    port = _free_port()
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    yield port, proc
    proc.kill()
    proc.wait()


async def test_requests_succeed_while_redis_is_down(infra, own_redis):
    port, redis_proc = own_redis
    pipe = await asyncio.to_thread(start_pipeline, infra, {"router": 1, "assembler": 1, "encode.text": 1},
                                   MMSTREAM_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                                   MMSTREAM_ROUTER_SERVED_MODALITIES="text")
    try:
        async with Client(pipe.bootstrap, pipe.prefix) as client:
            before = [await _ask(client, Part(Modality.TEXT, text=f"before {i}")) for i in range(5)]
            redis_proc.kill()
            redis_proc.wait()
            during = await asyncio.gather(*[_ask(client, Part(Modality.TEXT, text=f"during {i}")) for i in range(20)])
            repeat = await _ask(client, Part(Modality.TEXT, text="before 0"))
        assert all(e.kind == "result" for e in before + during + [repeat])
        assert [e.payload["parts"][0]["cache"] for e in before] == ["miss"] * 5
        assert repeat.payload["parts"][0]["cache"] == "miss"  # Redis is gone: recomputed, not failed
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)


async def test_an_identical_request_is_answered_whole_by_the_router(pipeline):
    text = f"whole answer {new_id()}"
    image = photo("coffee")
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        first = await _ask(client, Part(Modality.TEXT, text=text), Part(Modality.IMAGE, data=image, mime="image/jpeg"))
        again = None
        for _ in range(20):  # the router learns the encoders' model identities within seconds
            again = await _ask(client, Part(Modality.TEXT, text=text), Part(Modality.IMAGE, data=image, mime="image/jpeg"))
            if (again.cache or {}).get("result") == "hit":
                break
            await asyncio.sleep(0.5)
    assert again.cache["result"] == "hit"
    assert [s["stage"] for s in again.timings["stages"]] == ["route"]
    assert [p["embedding"] for p in again.payload["parts"]] == [p["embedding"] for p in first.payload["parts"]]


def test_one_round_trip_finds_hits_and_claims_each_miss_once(infra):
    """The lookup's Lua script on the real Redis: a stored key comes back as its value, the
    first worker to miss a key claims it, the next one sees the claim; a store frees it."""
    prefix = f"mm:test:{new_id()}"
    stored, missed = f"{prefix}:stored", f"{prefix}:missed"
    a = EncoderCache(infra.redis.url, ttl_s=60, timeout_s=1.0)
    b = EncoderCache(infra.redis.url, ttl_s=60, timeout_s=1.0)
    assert a.set_many([(stored, b"packed")])
    assert a.lookup_or_claim([stored, missed], hold_ms=5000) == [b"packed", True]
    assert b.lookup_or_claim([stored, missed], hold_ms=5000) == [b"packed", False]
    assert a.set_many([(missed, b"done")])  # the claimer stores its answer and drops the claim
    assert b.lookup_or_claim([missed], hold_ms=5000) == [b"done"]
    a.client.delete(stored, missed)
