"""Generation end to end on the real broker with the real language model: streamed tokens,
one result, grounding of an image by its labels, and the prefix cache at work."""

from __future__ import annotations

import pytest

from mmstream.samples import photo
from schemas.request import Modality, Params, Part, Request, Task
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gen_pipeline(infra):
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1, "generate": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image",
                          # A compute quota that sheds nothing here (100 s a second) but holds 3 s at
                          # once: a long generation is admitted in debt (the background test), priced
                          # at the router's default step cost or at the generator's measured one.
                          MMSTREAM_QUOTA_COMPUTE_MS_PER_S="100000", MMSTREAM_QUOTA_COMPUTE_BURST_MS="3000")
    yield pipe
    pipe.supervisor.stop()


async def _generate(client, *parts, max_tokens=32):
    sub = await client.submit(Request(id=new_id(), task=Task.GENERATE, parts=tuple(parts),
                                      params=Params(max_tokens=max_tokens), deadline_ms=120_000))
    return [e async for e in sub.events(timeout_s=120)]


async def test_capital_of_france_streams_tokens_then_one_result(gen_pipeline):
    async with Client(gen_pipeline.bootstrap, gen_pipeline.prefix) as client:
        events = await _generate(client, Part(Modality.TEXT, text="What is the capital of France?"))
    kinds = [e.kind for e in events]
    assert kinds[0] == "accepted" and kinds[-1] == "result" and kinds.count("token") >= 2, events[-1]
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    result = events[-1]
    assert "Paris" in result.payload["text"]
    assert "".join(e.payload["text"] for e in events if e.kind == "token") == result.payload["text"]
    t = result.timings
    assert t["ttft_ms"] > 0 and t["tpot_ms"] > 0 and [s["stage"] for s in t["stages"]][-1] == "generate"


async def test_a_cat_photo_grounds_the_answer_and_the_prefix_cache_hits(gen_pipeline):
    async with Client(gen_pipeline.bootstrap, gen_pipeline.prefix) as client:
        events = await _generate(client, Part(Modality.TEXT, text="What animal is in this picture?"),
                                 Part(Modality.IMAGE, data=photo("chelsea"), mime="image/jpeg"))
        again = await _generate(client, Part(Modality.TEXT, text="What is the capital of Italy?"))
    answer = events[-1].payload["text"].lower()
    assert events[-1].kind == "result" and "cat" in answer, answer
    # The system prompt is shared: the second request starts from its cached KV blocks.
    assert again[-1].payload["tokens"]["cached"] > 0


async def test_past_deadline_generation_is_deadline_exceeded(gen_pipeline):
    async with Client(gen_pipeline.bootstrap, gen_pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), task=Task.GENERATE, deadline_ms=300,
                                          parts=(Part(Modality.TEXT, text="Write a very long story about Kafka."),),
                                          params=Params(max_tokens=1000)))
        event = await sub.result(timeout_s=60)
    assert event.kind == "error" and event.error["code"] == "deadline_exceeded"


@pytest.fixture(scope="module")
def tight_pipeline(infra):
    """A generator held to a 300 ms rt TTFT bound: a burst past what it can start in time."""
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "generate": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text", MMSTREAM_GENERATOR_TTFT_BOUND_MS="300",
                          MMSTREAM_GENERATOR_MAX_RUNNING="2")
    yield pipe
    pipe.supervisor.stop()


async def test_a_burst_past_the_ttft_bound_is_shed_at_once_and_nothing_is_lost(tight_pipeline):
    import asyncio

    async with Client(tight_pipeline.bootstrap, tight_pipeline.prefix) as client:
        # A generator refuses only on measured steps of its own: let it run some first.
        warm = await _generate(client, Part(Modality.TEXT, text="Count from 1 to 30."), max_tokens=32)
        assert warm[-1].kind == "result"
        subs = [await client.submit(Request(id=new_id(), task=Task.GENERATE, deadline_ms=120_000,
                                            parts=(Part(Modality.TEXT, text=f"Count from {i} to {i + 40}."),),
                                            params=Params(max_tokens=48)))
                for i in range(24)]
        ends = await asyncio.gather(*(s.result(timeout_s=120) for s in subs))
    kinds = [e.kind for e in ends]
    shed = [e for e in ends if e.kind == "error"]
    assert len(ends) == 24 and kinds.count("result") >= 1 and shed, kinds
    for e in shed:
        assert e.error["code"] == "overloaded" and e.error["retry_after_ms"] >= 100, e.error
        assert "first token" in e.error["message"]


async def test_the_generator_publishes_the_step_cost_the_router_prices_with(gen_pipeline):
    from streams.policies.gen_price import ROUTER_GEN_COST, costliest
    from streams.stores import load_reports
    from workers.redisconn import connect_async

    settings = gen_pipeline.settings
    redis = connect_async(settings.redis.url, settings.redis.tls_ca)
    try:
        reports = await load_reports.read_gen_costs(redis, gen_pipeline.prefix)
    finally:
        await redis.aclose()
    assert len(reports) == 1 and next(iter(reports)).startswith("generate/"), reports
    from schemas.trace import now_ms

    cost = costliest(reports, now_ms())
    # Measured here, not the constant: llama.cpp's threads, a step cost learned on this machine.
    assert cost != ROUTER_GEN_COST and cost.threads >= 1 and cost.fixed_ms + cost.per_decode_ms > 0, cost


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="coming back from a lowering needs root or RLIMIT_NICE")
async def test_a_generation_admitted_in_debt_runs_the_generator_lower_until_it_ends(gen_pipeline):
    """Priced over its tenant's whole compute bucket (256 tokens: 4.9-7.6 s, over 3 s), it is
    admitted in debt and the generator runs at quota.debt_nice (10) below its level while it
    holds it, and back at its level after."""
    import asyncio
    import os

    [gen] = [w for w in gen_pipeline.supervisor.workers() if w.stage == "generate"]
    seen: set[int] = set()
    async with Client(gen_pipeline.bootstrap, gen_pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), task=Task.GENERATE, deadline_ms=120_000,
                                          parts=(Part(Modality.TEXT, text="Count from 1 to 200, one number a line."),),
                                          params=Params(max_tokens=256)))
        done = asyncio.create_task(sub.result(timeout_s=120))
        while not done.done():
            seen.add(os.getpriority(os.PRIO_PROCESS, gen.pid))
            await asyncio.sleep(0.02)
        assert (await done).kind == "result"
    assert 10 in seen, seen
    for _ in range(100):  # its result leaves before the step loop notes it holds nothing
        if os.getpriority(os.PRIO_PROCESS, gen.pid) == 0:
            break
        await asyncio.sleep(0.05)
    assert os.getpriority(os.PRIO_PROCESS, gen.pid) == 0


async def test_tokens_owed_back_go_to_the_router_that_charged_them_and_are_taken_once(infra):
    """The generators add what each tenant is owed under the router replica that charged it;
    that router takes its own (and the shared hash's, for manifests that name no router) in
    one transaction, so a second read finds nothing, and another router never gets them."""
    import uuid

    from streams.stores import load_reports
    from workers.redisconn import connect_async

    prefix = f"t{uuid.uuid4().hex[:10]}"
    redis = connect_async(infra.redis.url, infra.redis.tls_ca)
    try:
        assert await load_reports.add_gen_credits(redis, prefix, {"router/1": {"a": 250, "b": 3}, "router/2": {"a": 4}})
        assert await load_reports.add_gen_credits(redis, prefix, {"router/1": {"a": 10}, None: {"a": 1}})  # another generator's
        assert 0 < await redis.ttl(load_reports.gen_credit_key(prefix, "router/2")) <= load_reports.CREDIT_TTL_S
        assert await load_reports.take_gen_credits(redis, prefix, "router/1") == {"a": 261, "b": 3}
        assert await load_reports.take_gen_credits(redis, prefix, "router/1") == {}
        assert await load_reports.take_gen_credits(redis, prefix, "router/2") == {"a": 4}
        await redis.hset(load_reports.gen_credit_key(prefix, "r"), mapping={"c": "junk", "d": "-4", "e": "7"})
        assert await load_reports.take_gen_credits(redis, prefix, "r") == {"e": 7}  # what is not a count is passed over
    finally:
        await redis.aclose()


@pytest.fixture(scope="module")
def metered_pipeline(infra):
    """A compute quota that refills 10 ms a second and holds 20 s: two 512-token answers are
    more than it holds, unless the first gives back what it did not generate."""
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "generate": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text",
                          MMSTREAM_QUOTA_COMPUTE_MS_PER_S="10", MMSTREAM_QUOTA_COMPUTE_BURST_MS="20000")
    yield pipe
    pipe.supervisor.stop()


async def test_a_short_answer_gives_back_the_tokens_it_did_not_make(metered_pipeline):
    """Each request is charged its 512 tokens (~15 s here); the first stops after a few, and
    what it did not make comes back to the tenant's bucket within a few seconds (the generator
    hands it to Redis every 2 s, the router takes it every 250 ms): the second gets in. Without
    the refund it would wait ~25 minutes at 10 ms a second."""
    import asyncio

    def ask(text):
        return Request(id=new_id(), task=Task.GENERATE, deadline_ms=60_000, parts=(Part(Modality.TEXT, text=text),),
                       params=Params(max_tokens=512))

    async with Client(metered_pipeline.bootstrap, metered_pipeline.prefix) as client:
        first = await (await client.submit(ask("What is the capital of France?"))).result(timeout_s=60)
        assert first.kind == "result" and first.payload["tokens"]["completion"] < 100, first.payload
        outcomes = []
        for _ in range(20):
            second = await (await client.submit(ask("What is the capital of Italy?"))).result(timeout_s=60)
            outcomes.append(second.kind)
            if second.kind == "result":
                break
            assert second.error["code"] == "overloaded" and "compute" in second.error["message"], second.error
            await asyncio.sleep(0.5)
    assert outcomes[-1] == "result", outcomes
