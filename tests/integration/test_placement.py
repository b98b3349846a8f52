"""Placement on the real pipeline (``router.colocate``): a router that encodes text in its
own process answers text with no text pool deployed at all. At light load no text job
crosses the broker (the text topic stays empty); in a burst, jobs past the router's bound go
through the text topic, which the router's encoder also reads as a member of the pool, unless
``router.colocate_pool`` is off: then it reads no topic and the pool alone serves them."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.request import Modality, Part, Request
from streams.app import group_id
from streams.sdk.client import Client, new_id
from streams.observe.lagmon import _group_fields
from tests.integration.conftest import start_pipeline, wait_ready

pytestmark = pytest.mark.integration


async def _records_in(bootstrap: str, topic: str, partitions: int) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in range(partitions)])
        return sum(ends.values())
    finally:
        await consumer.stop()


async def _texts(pipe, texts: list[str]) -> list:
    async with Client(pipe.bootstrap, pipe.prefix) as client:
        subs = [await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=t),))) for t in texts]
        return await asyncio.gather(*(s.result(timeout_s=120) for s in subs))


@pytest.mark.parametrize("bound_ms", ["25", "0"])
async def test_a_router_with_text_placed_in_it_serves_text_without_a_pool(infra, bound_ms):
    pipe = await asyncio.to_thread(start_pipeline, infra, {"router": 1, "assembler": 1},
                                   MMSTREAM_ROUTER_COLOCATE="text", MMSTREAM_ROUTER_SERVED_MODALITIES="text",
                                   MMSTREAM_ROUTER_COLOCATE_POOL="true", MMSTREAM_ROUTER_COLOCATE_MAX_QUEUED_MS=bound_ms)
    try:
        await wait_ready(pipe)
        topic = f"{pipe.prefix}.encode.text.rt"
        partitions = pipe.settings.kafka.partitions
        before = await _records_in(pipe.bootstrap, topic, partitions)
        one_by_one = []
        for i in range(5):
            one_by_one += await _texts(pipe, [f"placed text number {i} {new_id()}"])
        light = await _records_in(pipe.bootstrap, topic, partitions) - before
        burst = await _texts(pipe, [f"burst text {i} {new_id()}" for i in range(40)])
        crossed = await _records_in(pipe.bootstrap, topic, partitions) - before - light
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    for e in one_by_one + burst:
        assert e.kind == "result", e.error
        assert [s["stage"] for s in e.timings["stages"]] == ["route", "encode.text", "assemble"]
        assert e.payload["parts"][0]["embedding"] is not None
    assert light == 0  # one at a time, every job was encoded in the router's process
    if bound_ms == "0":  # a job is taken only while nothing is queued: a burst overflows to the topic
        assert 0 < crossed < len(burst)


async def _members(bootstrap: str, group: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for response in await admin.describe_consumer_groups([group]):
            for g in response.groups:
                return len(_group_fields(g)[2])
        return 0
    finally:
        await admin.close()


async def test_a_router_encoder_outside_the_pool_takes_only_its_hand_overs(infra):
    pipe = await asyncio.to_thread(start_pipeline, infra, {"router": 1, "assembler": 1, "encode.text": 1},
                                   MMSTREAM_ROUTER_COLOCATE="text", MMSTREAM_ROUTER_COLOCATE_POOL="false",
                                   MMSTREAM_ROUTER_COLOCATE_MAX_QUEUED_MS="0")
    try:
        await wait_ready(pipe)
        topic = f"{pipe.prefix}.encode.text.rt"
        partitions = pipe.settings.kafka.partitions
        before = await _records_in(pipe.bootstrap, topic, partitions)
        one = await _texts(pipe, [f"handed over {new_id()}"])
        light = await _records_in(pipe.bootstrap, topic, partitions) - before
        burst = await _texts(pipe, [f"burst text {i} {new_id()}" for i in range(40)])
        crossed = await _records_in(pipe.bootstrap, topic, partitions) - before - light
        members = await _members(pipe.bootstrap, group_id(pipe.prefix, "encode.text"))
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    for e in one + burst:
        assert e.kind == "result", e.error
        assert e.payload["parts"][0]["embedding"] is not None
    assert light == 0 and 0 < crossed < len(burst)  # both placements were used
    assert members == 1  # the pool's replica alone reads the topic: the router's encoder is no member
