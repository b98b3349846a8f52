"""The router's backlog bound on the real broker: a router stalled while rt requests keep
coming (SIGSTOP, as a long pause or a starved core would) finds a standing backlog when it
wakes; on a box past its capacity (admission refusing for it) what waited past
``router.max_wait_rt_ms`` since the broker appended it is answered ``overloaded`` with a
retry-after, and every request still gets exactly one answer."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas.request import Modality, Part, Request
from schemas.topics import TopicNames
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration

STALL_S = 2.5
SENT = 90
"""Requests sent while the router is stopped: more than one of its routing groups (32), so
admission's refusals in the first arm the bound for the next."""


@pytest.fixture(scope="module")
def tight_pipeline(infra):
    # rt admission at 1 ms: an idle pool admits (IDLE_SHARE), a pool with anything reserved
    # refuses for want of capacity, so a backlog read at once is past capacity by its second request.
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text",
                          MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT="1",
                          MMSTREAM_CACHE_ENABLED="false")
    yield pipe
    pipe.supervisor.stop()


async def test_ingress_records_carry_the_brokers_append_time(tight_pipeline):
    pipe = tight_pipeline
    topic = TopicNames(pipe.prefix).ingress("rt")
    producer = AIOKafkaProducer(bootstrap_servers=pipe.bootstrap)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, b"not a request", key=b"k", timestamp_ms=1_000)  # back-dated
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=pipe.bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, meta.partition)
        consumer.assign([tp])
        consumer.seek(tp, meta.offset)
        got = (await consumer.getmany(tp, timeout_ms=10_000, max_records=1))[tp][0]
    finally:
        await consumer.stop()
    assert got.timestamp_type == 1 and got.timestamp > 1_000_000_000_000  # the broker's clock, not the client's


async def test_requests_that_waited_in_a_stalled_routers_backlog_are_refused_and_all_answered(tight_pipeline):
    pipe = tight_pipeline
    router = next(w for w in pipe.supervisor.workers() if w.stage == "router")
    async with Client(pipe.bootstrap, pipe.prefix) as client:
        warm = await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="warm"),)))
        assert (await warm.result(timeout_s=60)).kind == "result"
        os.kill(router.pid, signal.SIGSTOP)
        try:
            subs = []
            for i in range(SENT):
                subs.append(await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=f"stalled {i}"),))))
                await asyncio.sleep(STALL_S / SENT)
        finally:
            os.kill(router.pid, signal.SIGCONT)
        events = await asyncio.gather(*(s.result(timeout_s=120) for s in subs))
    late = [e for e in events if e.kind == "error" and "for the router" in (e.error or {}).get("message", "")]
    assert late, [(e.kind, (e.error or {}).get("message")) for e in events[:5]]
    assert all(e.error["code"] == "overloaded" and e.error["retriable"] and e.error["retry_after_ms"] >= 400
               for e in late)
    others = [e for e in events if e not in late]
    assert all(e.kind == "result" or (e.error or {}).get("code") == "overloaded" for e in others), \
        [e.error for e in others if e.kind != "result"][:3]
    print(f"\n{len(late)} refused for their wait, {sum(e.kind == 'result' for e in events)} answered, "
          f"{len(others) - sum(e.kind == 'result' for e in others)} refused by admission")
