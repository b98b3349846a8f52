"""Trust on the real broker and a real Redis (issue 11, items 3-8): each finding of the review,
and variants of it, refused with a stable code.

The pipeline here runs against its own Redis, secured as a deployment would be: TLS
(``rediss://``, a locally made CA) and ACL users — the workers' user (every ``mm:*`` key)
and the clients' user (SET and GET of ``mm:claim:*`` only), which the SDK uses. One tenant,
``noisy``, has a rate quota of 1 request per second (burst 2).
"""

from __future__ import annotations

import asyncio
import gzip
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis as redis_py
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from mmstream.localstack.redis import LocalRedis
from mmstream.samples import photo
from schemas.codec import ERROR_HEADER, pack
from schemas.jobs import EncodedPart
from schemas.request import Modality, Part, Request
from schemas.settings import LocalSettings, describe
from schemas.tensor import from_wire, to_wire
from streams.sdk.client import Client, new_id
from tests.integration.conftest import REPO, start_pipeline
from tests.integration.kafka_io import read_to_end, terminal_events
from workers.redisconn import connect

pytestmark = pytest.mark.integration

WORKER_PW = f"w-{uuid.uuid4().hex}"
CLIENT_PW = f"c-{uuid.uuid4().hex}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def secured_redis():
    """A Redis of our own on a free port: TLS, ACL users; stopped afterwards."""
    port = _free_port()
    state = Path(tempfile.mkdtemp(prefix="mm-trust-"))
    worker = f"rediss://mmworker:{WORKER_PW}@127.0.0.1:{port}/0"
    client = f"rediss://mmclient:{CLIENT_PW}@127.0.0.1:{port}/0"
    local = LocalRedis(LocalSettings(state_dir=state), worker, client_url=client)
    local.start()
    yield {"url": worker, "client_url": client, "ca": local.tls_ca, "port": port, "local": local}
    local.stop()
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def trust(infra, secured_redis):
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1, "encode.video": 1},
                          MMSTREAM_REDIS_URL=secured_redis["url"], MMSTREAM_REDIS_CLIENT_URL=secured_redis["client_url"],
                          MMSTREAM_REDIS_TLS_CA=secured_redis["ca"], MMSTREAM_QUOTA_OVERRIDES="noisy=1:2",
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image,video")
    yield pipe
    pipe.supervisor.stop()


def client(pipe, secured_redis, reply_to=None, **kw) -> Client:
    return Client(pipe.bootstrap, pipe.prefix, reply_to=reply_to, redis_url=secured_redis["client_url"],
                  redis_tls_ca=secured_redis["ca"], **kw)


async def reply_topic(pipe, name: str) -> str:
    """A reply topic of one tenant, created and visible in the cluster's metadata."""
    topic = f"{pipe.prefix}.results.{name}"
    admin = AIOKafkaAdminClient(bootstrap_servers=pipe.bootstrap)
    await admin.start()
    try:
        if topic not in await admin.list_topics():
            await admin.create_topics([NewTopic(topic, 2, 1)])
        for _ in range(100):
            if topic in await admin.list_topics():
                break
            await asyncio.sleep(0.1)
    finally:
        await admin.close()
    await asyncio.sleep(1.0)  # the router's topic cache and the partitions' leaders
    return topic


async def produce(bootstrap: str, topic: str, key: bytes | None, value: bytes, **kw) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **kw)
    await producer.start()
    try:
        await (await producer.send(topic, value, key=key))
    finally:
        await producer.stop()


def embedding(event, i=0) -> np.ndarray:
    return from_wire(event.payload["parts"][i]["embedding"]).astype(np.float32)


# -- 3. namespaces ------------------------------------------------------------------------------


async def test_the_same_id_from_two_tenants_is_two_requests(trust, secured_redis):
    rid = f"shared-{new_id()}"
    topics = [await reply_topic(trust, t) for t in ("a", "b")]
    async with client(trust, secured_redis, topics[0]) as a, client(trust, secured_redis, topics[1]) as b:
        sub_a = await a.submit(Request(id=rid, tenant="tenant-a", parts=(Part(Modality.TEXT, text="apples and pears"),)))
        sub_b = await b.submit(Request(id=rid, tenant="tenant-b", parts=(Part(Modality.TEXT, text="interest rates"),)))
        got_a, got_b = await asyncio.gather(sub_a.result(timeout_s=60), sub_b.result(timeout_s=60))
        fresh = await (await a.submit(Request(id=new_id(), tenant="tenant-b",
                                              parts=(Part(Modality.TEXT, text="interest rates"),)))).result(timeout_s=60)
    assert got_a.kind == got_b.kind == "result"
    assert float(embedding(got_a) @ embedding(got_b)) < 0.9  # each got its own answer
    assert np.allclose(embedding(got_b), embedding(fresh), atol=1e-2)


async def test_a_reused_id_of_the_same_tenant_is_refused_never_swallowed(trust, secured_redis):
    rid = f"dup-{new_id()}"
    async with client(trust, secured_redis) as c:
        first = await (await c.submit(Request(id=rid, tenant="dup", parts=(Part(Modality.TEXT, text="one"),)))
                       ).result(timeout_s=60)
        assert first.kind == "result"
        # Another request with the used id (other content), then the same request sent again.
        for text in ("two", "one"):
            again = await (await c.submit(Request(id=rid, tenant="dup", parts=(Part(Modality.TEXT, text=text),)))
                           ).result(timeout_s=60)
            assert again.kind == "error" and again.error["code"] == "invalid_request"
            assert "id already used" in again.error["message"] and again.error["field"] == "id"
        # Two at once: the first is answered, the second refused; both get a terminal event.
        rid2 = f"dup2-{new_id()}"
        await c.submit(Request(id=rid2, tenant="dup", parts=(Part(Modality.TEXT, text="first of two"),)))
        await c.submit(Request(id=rid2, tenant="dup", parts=(Part(Modality.TEXT, text="second of two"),)))
    on_wire = (await terminal_events(trust.bootstrap, f"{trust.prefix}.results", {rid2}))[rid2]
    assert sorted(e.kind for e in on_wire) == ["error", "result"]
    refusal = next(e for e in on_wire if e.kind == "error")
    assert refusal.error["code"] == "invalid_request" and "id already used" in refusal.error["message"]


# -- 4. internal records are trusted only from the pipeline -------------------------------------


async def test_a_forged_part_neither_completes_a_request_nor_poisons_the_cache(trust, secured_redis):
    text = f"forgery target {new_id()}"
    rid = new_id()
    forged = EncodedPart(id=rid, part=0, modality="text", sent_at_ms=0.0, embedding=to_wire(np.full(384, 0.05)),
                         tenant="default", nonce="guessed")
    encoded = f"{trust.prefix}.encoded.rt"
    # Before the request, under its key and under the bare id (the keys of old), with and without a nonce.
    for key, part in ((f"default/{rid}", forged), (rid, forged), (f"default/{rid}", replace(forged, nonce=None))):
        await produce(trust.bootstrap, encoded, key.encode(), pack(part.to_wire()))
    async with client(trust, secured_redis) as c:
        real = await (await c.submit(Request(id=rid, parts=(Part(Modality.TEXT, text=text),)))).result(timeout_s=60)
        again = await (await c.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=text),)))).result(timeout_s=60)
        reference = await (await c.submit(Request(id=new_id(), tenant="reference",
                                                  parts=(Part(Modality.TEXT, text=text),)))).result(timeout_s=60)
    assert real.kind == "result" and again.kind == "result"
    assert real.payload["parts"][0]["cache"] in ("miss", "hit")  # computed by the encoder, not the forgery
    assert not np.allclose(embedding(real), 0.05, atol=1e-3)
    assert np.allclose(embedding(real), embedding(reference), atol=1e-2)
    assert again.cache.get("result") == "hit"  # the whole answer was cached: the genuine one
    assert np.allclose(embedding(again), embedding(reference), atol=1e-2)


# -- 5. refs and media ----------------------------------------------------------------------------


async def test_refs_resolve_only_in_the_tenants_claim_namespace_and_refusals_leak_nothing(trust, secured_redis):
    image = photo("chelsea")
    async with client(trust, secured_redis, inline_limit_bytes=10_000) as c:
        mine = await (await c.submit(Request(id=new_id(), tenant="acme",
                                             parts=(Part(Modality.IMAGE, data=image, mime="image/jpeg"),)))
                      ).result(timeout_s=90)
        assert mine.kind == "result" and mine.payload["parts"][0]["embedding"] is not None
        owner = connect(secured_redis["url"], secured_redis["ca"])
        acme_key = next(k.decode() for k in owner.scan_iter("mm:claim:acme:*"))
        cache_key = next((k.decode() for k in owner.scan_iter("mm:*") if not k.startswith(b"mm:claim:")), "mm:res:x")
        refs = [f"redis:{acme_key}", f"redis:{cache_key}", "redis:mm:claim:evil:nothing:0", "redis:mm:load:mm",
                f"redis:mm:claim:evil:{acme_key}", "file:///etc/passwd",
                f"file://{REPO}/docs/capacity/latency_cdf.png"]
        evil = await (await c.submit(Request(id=new_id(), tenant="evil", parts=tuple(
            Part(Modality.IMAGE, ref=ref, mime="image/jpeg") for ref in refs)))).result(timeout_s=60)
    assert evil.kind == "error" and evil.error["code"] == "invalid_request"
    errors = [p["error"] for p in evil.payload["parts"]]
    assert [e["code"] for e in errors] == ["invalid_request"] * len(refs)
    redis_messages = {e["message"] for e in errors[:5]}
    assert len(redis_messages) == 1  # another tenant's key, a cache key, an absent one: the same answer
    for e in errors:
        assert str(len(image)) not in e["message"] and image[:8].hex() not in e["message"]


async def test_the_ffconcat_video_and_other_demuxer_tricks_are_unsupported_media(trust, secured_redis, tmp_path):
    # The worker runs in the repository: a relative path there names a real PNG.
    tricks = [b"ffconcat version 1.0\nfile docs/capacity/latency_cdf.png\n",
              b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\ndocs/capacity/latency_cdf.png\n#EXT-X-ENDLIST\n",
              (REPO / "docs/capacity/latency_cdf.png").read_bytes()]
    async with client(trust, secured_redis) as c:
        event = await (await c.submit(Request(id=new_id(), parts=tuple(
            Part(Modality.VIDEO, data=t, mime="video/mp4") for t in tricks)))).result(timeout_s=60)
    assert event.kind == "error" and event.error["code"] == "unsupported_media"
    assert [p["error"]["code"] for p in event.payload["parts"]] == ["unsupported_media"] * 3
    assert all(not p["extras"].get("frames_encoded") for p in event.payload["parts"])


async def test_hostile_records_on_internal_topics_never_stop_a_stage(trust, secured_redis):
    marker = new_id().encode()
    deep: list = [1]
    for _ in range(40):
        deep = [deep]
    hostile = [b"\x81\x91\x00\x00" + marker,  # a map keyed by a list (TypeError inside msgpack)
               msgpack.packb({"v": 1, "type": "part", "id": "x", "extras": deep}),  # nested past the bound
               b"\x91" * 5000 + marker]  # deeper than msgpack's stack
    for topic in (f"{trust.prefix}.encoded.rt", f"{trust.prefix}.encode.video.rt", f"{trust.prefix}.encode.text.rt"):
        for value in hostile:
            await produce(trust.bootstrap, topic, marker, value)
    async with client(trust, secured_redis) as c:
        ok = await (await c.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="still standing"),)))
                    ).result(timeout_s=60)
    assert ok.kind == "result", ok.error
    parked = [r for r in await read_to_end(trust.bootstrap, f"{trust.prefix}.dlq") if r.key == marker]
    assert len(parked) == 9 and all(dict(r.headers)[ERROR_HEADER].startswith(b"invalid_request") for r in parked)


# -- 6. Redis users and TLS -----------------------------------------------------------------------


def test_the_clients_redis_user_writes_claim_checks_and_nothing_else(secured_redis):
    c = connect(secured_redis["client_url"], secured_redis["ca"])
    c.set("mm:claim:acme:r:0", b"bytes", ex=60)
    assert c.get("mm:claim:acme:r:0") == b"bytes"
    for attempt in (lambda: c.set("mm:enc:v1|text|forged", b"x"), lambda: c.set("mm:res:v1|forged", b"x"),
                    lambda: c.hset("mm:models:mm", "text", "forged"), lambda: c.hgetall("mm:load:mm"),
                    lambda: c.get("mm:res:v1|anything"), lambda: c.flushall(), lambda: c.keys("*")):
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            attempt()
    w = connect(secured_redis["url"], secured_redis["ca"])
    w.set("mm:enc:v1|probe", b"1", ex=60)
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        w.flushall()
    with pytest.raises(redis_py.exceptions.RedisError):  # nobody without a password
        connect(f"rediss://127.0.0.1:{secured_redis['port']}/0", secured_redis["ca"]).get("mm:claim:acme:r:0")
    with pytest.raises(redis_py.exceptions.ConnectionError):  # and nobody in the clear
        connect(secured_redis["client_url"].replace("rediss://", "redis://"), socket_timeout=2).get("mm:claim:x:0")


def test_one_tenants_redis_user_reaches_only_its_own_claim_checks(secured_redis):
    secured_redis["local"].add_client_user("tenant-globex", "globex-pw", "globex")
    url = f"rediss://tenant-globex:globex-pw@127.0.0.1:{secured_redis['port']}/0"
    t = connect(url, secured_redis["ca"])
    t.set("mm:claim:globex:r:0", b"ok", ex=60)
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        t.get("mm:claim:acme:r:0")
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        t.set("mm:claim:acme:r:0", b"overwrite")


def test_config_and_status_never_print_a_password(trust, secured_redis):
    env = {**trust.env, "PYTHONPATH": str(REPO)}
    for command in (["config"], ["status"]):
        out = subprocess.run([sys.executable, "-m", "mmstream.cli", *command], env=env, capture_output=True,
                             text=True, timeout=60)
        assert WORKER_PW not in out.stdout + out.stderr and CLIENT_PW not in out.stdout + out.stderr
    rows = describe(trust.settings)
    assert any(var == "MMSTREAM_REDIS_CLIENT_URL" and "***" in str(value) for var, value, _ in rows)


# -- 7. DLQ hygiene and compressed batches ----------------------------------------------------------


async def test_the_dlq_forgets_and_a_compressed_bomb_never_reaches_a_stage(trust):
    admin = AIOKafkaAdminClient(bootstrap_servers=trust.bootstrap)
    await admin.start()
    try:
        described = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, f"{trust.prefix}.dlq"),
                                                  ConfigResource(ConfigResourceType.TOPIC, f"{trust.prefix}.ingress.rt")])
    finally:
        await admin.close()
    # (error code, message, type, name, [(config, value, ...)]) per resource
    configs = {res[3]: {c[0]: c[1] for c in res[4]} for d in described for res in d.resources}
    dlq, ingress = configs[f"{trust.prefix}.dlq"], configs[f"{trust.prefix}.ingress.rt"]
    assert dlq["retention.ms"] == str(trust.settings.dlq.retention_ms)
    assert dlq["retention.bytes"] == str(trust.settings.dlq.retention_bytes)
    assert ingress["compression.type"] == "uncompressed"
    bomb = b"\0" * (trust.settings.kafka.max_message_bytes * 2)  # a few KB of gzip
    assert len(gzip.compress(bomb)) < 100_000
    from aiokafka.errors import MessageSizeTooLargeError

    with pytest.raises(MessageSizeTooLargeError):
        await produce(trust.bootstrap, f"{trust.prefix}.ingress.rt", b"bomb", bomb, compression_type="gzip",
                      max_request_size=len(bomb) + 1024, max_batch_size=len(bomb) + 1024)


# -- 8. per-tenant quotas -------------------------------------------------------------------------


async def test_a_noisy_tenant_is_shed_and_a_quiet_one_is_not(trust, secured_redis):
    async with client(trust, secured_redis) as c:
        noisy = [await c.submit(Request(id=new_id(), tenant="noisy", parts=(Part(Modality.TEXT, text=f"n{i}"),)))
                 for i in range(6)]
        quiet = [await c.submit(Request(id=new_id(), tenant="quiet", parts=(Part(Modality.TEXT, text=f"q{i}"),)))
                 for i in range(6)]
        noisy_events = await asyncio.gather(*(s.result(timeout_s=60) for s in noisy))
        quiet_events = await asyncio.gather(*(s.result(timeout_s=60) for s in quiet))
    shed = [e for e in noisy_events if e.kind == "error"]
    assert len(shed) >= 3 and all(e.error["code"] == "overloaded" and e.error["retriable"] for e in shed)
    assert all(0 < e.error["retry_after_ms"] <= 1000 and "noisy" in e.error["message"] for e in shed)
    assert [e.kind for e in quiet_events] == ["result"] * 6
