"""Direct answers on the real pipeline (``router.answer_local``): a text the router's own
encoder encodes is answered by the router (its answer and a done marker on
``<prefix>.router.done``; nothing on the encoded topic for the assembler), a duplicate record
of it is never answered twice, not even by a router started after the first was killed, and
another request with its id is refused."""

from __future__ import annotations

import asyncio
import signal

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas.codec import CONTENT_TYPE_HEADER, MSGPACK, pack
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline, wait_ready
from tests.integration.kafka_io import terminal_events

pytestmark = pytest.mark.integration


async def _records_in(bootstrap: str, topic: str, partitions: int) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        return sum((await consumer.end_offsets([TopicPartition(topic, p) for p in range(partitions)])).values())
    finally:
        await consumer.stop()


def _pipeline(infra, answer_local: str):
    return start_pipeline(infra, {"router": 1, "assembler": 1}, MMSTREAM_ROUTER_COLOCATE="text",
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text", MMSTREAM_ROUTER_COLOCATE_POOL="true",
                          MMSTREAM_ROUTER_ANSWER_LOCAL=answer_local)


@pytest.mark.parametrize("answer_local", ["true", "false"])
async def test_a_text_the_router_encodes_is_answered_by_the_router(infra, answer_local):
    pipe = await asyncio.to_thread(_pipeline, infra, answer_local)
    n = pipe.settings.kafka.partitions
    try:
        await wait_ready(pipe)
        counted = (f"{pipe.prefix}.encoded.rt", f"{pipe.prefix}.router.done")
        before = [await _records_in(pipe.bootstrap, t, n) for t in counted]
        async with Client(pipe.bootstrap, pipe.prefix) as client:
            texts = [f"one {i} {new_id()}" for i in range(5)]  # never answered from the result cache
            answers = [await (await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=t),)))
                              ).result(timeout_s=120) for t in texts]
        encoded, markers = [await _records_in(pipe.bootstrap, t, n) - b for t, b in zip(counted, before)]
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    for e in answers:
        assert e.kind == "result" and e.payload["parts"][0]["embedding"] is not None
        assert [s["stage"] for s in e.timings["stages"]] == ["route", "encode.text", "assemble"]
    if answer_local == "true":
        assert (encoded, markers) == (0, 5)  # the assembler never heard of them
    else:
        assert encoded >= 10 and markers == 0  # a manifest and a part each, answered by the assembler


async def _send_raw(bootstrap: str, topic: str, rid: str, text: str, timestamp_ms: int) -> None:
    """One ingress record, exactly these bytes at exactly this timestamp: sent twice, it is the
    same record twice (the same digest), as a replay or a producer's duplicate would be."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        value = pack(Request(id=rid, parts=(Part(Modality.TEXT, text=text),)).to_wire())
        await (await producer.send(topic, value, key=rid.encode(), timestamp_ms=timestamp_ms,
                                   headers=[(CONTENT_TYPE_HEADER, MSGPACK.encode())]))
    finally:
        await producer.stop()


async def test_a_duplicate_is_dropped_and_a_reused_id_refused_across_a_router_restart(infra):
    pipe = await asyncio.to_thread(_pipeline, infra, "true")
    ingress, results = f"{pipe.prefix}.ingress.rt", f"{pipe.prefix}.results"
    rid, at = f"dup-{new_id()}", 1_700_000_000_000
    try:
        await wait_ready(pipe)
        for _ in range(2):
            await _send_raw(pipe.bootstrap, ingress, rid, "the same record twice", at)
        first = (await terminal_events(pipe.bootstrap, results, {rid}))[rid]
        router = next(w for w in pipe.supervisor.workers() if w.stage == "router")
        await asyncio.to_thread(pipe.supervisor.stop_one, router, 5.0, signal.SIGKILL)
        await asyncio.to_thread(pipe.supervisor.spawn_missing, "router", 1)
        await wait_ready(pipe)
        # The new router knows the request from its done marker only.
        await _send_raw(pipe.bootstrap, ingress, rid, "the same record twice", at)
        await _send_raw(pipe.bootstrap, ingress, rid, "another request with that id", at + 1)
        await asyncio.sleep(5)
        after = (await terminal_events(pipe.bootstrap, results, {rid}))[rid]
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    assert [e.kind for e in first] == ["result"]
    assert [e.kind for e in after] == ["result", "error"]
    assert after[1].error["code"] == "invalid_request" and "id already used" in after[1].error["message"]
