"""The router's price of a generate request: the generators' measured step cost, as if the
sequence ran alone, times the engine's threads."""

import math

import pytest

from streams.policies.gen_price import (ROUTER_GEN_COST, STALE_MS, GenCost, costliest, estimate_prompt_tokens,
                                        price_generate_ms, token_price_ms)


def test_a_generate_request_is_priced_by_its_prompt_and_max_tokens():
    short, long_prompt = estimate_prompt_tokens(30, 0), estimate_prompt_tokens(30_000, 0)
    assert long_prompt > 100 * short / 10 and estimate_prompt_tokens(30, 1) > short
    assert price_generate_ms(short, 256) > 10 * price_generate_ms(short, 16) / 2
    assert price_generate_ms(long_prompt, 16) > price_generate_ms(short, 16)


def test_each_step_pays_its_whole_fixed_cost_on_every_thread():
    cost = GenCost(fixed_ms=10.0, per_decode_ms=2.0, per_prompt_ms=0.5, threads=2)
    # A prompt of 100 tokens, then 50 steps each 10 + 2 ms of both threads.
    assert price_generate_ms(100, 50, cost) == pytest.approx(2 * 100 * 0.5 + 50 * 2 * 12.0)
    one_thread = GenCost(10.0, 2.0, 0.5, 1)
    assert price_generate_ms(100, 50, cost) == pytest.approx(2 * price_generate_ms(100, 50, one_thread))
    # Shared by four: each step's fixed cost split four ways, the decodes not.
    assert price_generate_ms(100, 50, cost, shared_by=4) == pytest.approx(2 * 100 * 0.5 + 50 * 2 * (2.5 + 2.0))
    # The constant before any report: one 1,024-token generation is dearer than the quota's
    # 2 s burst, so it leaves its tenant in debt (it was 4.9 s at a batch of 8 on one thread).
    assert price_generate_ms(900, 1024) > 19_000


def test_the_router_prices_with_the_dearest_fresh_report():
    now = 1_000_000.0
    slow = GenCost(20.0, 7.0, 0.7, 2).to_map(now - 1_000)
    fast = GenCost(6.0, 3.5, 0.35, 2).to_map(now - 500)
    stale = GenCost(90.0, 9.0, 0.9, 2).to_map(now - STALE_MS - 1)
    assert costliest({"a": fast, "b": slow, "c": stale}, now) == GenCost.from_map(slow)
    assert costliest({"c": stale}, now) == ROUTER_GEN_COST  # none fresh: the constant
    assert costliest({}, now) == ROUTER_GEN_COST
    last = GenCost.from_map(slow)  # what the router used before: kept while no report is fresh
    assert costliest({"c": stale}, now, default=last) == last


@pytest.mark.parametrize("bad", [
    {"at": 0, "fixed_ms": -1, "per_decode_ms": 1, "per_prompt_ms": 1, "threads": 2},
    {"at": 0, "fixed_ms": math.nan, "per_decode_ms": 1, "per_prompt_ms": 1, "threads": 2},
    {"at": 0, "fixed_ms": 1, "per_decode_ms": 1, "per_prompt_ms": 1, "threads": 0},
    {"at": 0, "fixed_ms": 1, "per_decode_ms": 1, "threads": 2},
    {"at": "soon", "fixed_ms": 1, "per_decode_ms": 1, "per_prompt_ms": 1, "threads": 2},
])
def test_a_report_that_is_no_step_cost_is_passed_over(bad):
    good = GenCost(6.0, 3.5, 0.35, 2)
    assert costliest({"bad": bad, "good": good.to_map(0)}, 1.0) == good


def test_a_report_reads_back_as_it_was_published():
    cost = GenCost(12.34, 5.6, 0.456, 3)
    assert GenCost.from_map(cost.to_map(7.0)) == cost and cost.to_map(7.0)["at"] == 7


def test_a_token_not_made_gives_back_what_it_was_charged():
    cost = GenCost(fixed_ms=9.5, per_decode_ms=5.4, per_prompt_ms=4.6, threads=2)
    for shared in (1, 4):
        each = price_generate_ms(60, 65, cost, shared) - price_generate_ms(60, 64, cost, shared)
        assert abs(token_price_ms(cost, shared) - each) < 1e-9
