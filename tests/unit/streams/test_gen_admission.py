"""The step cost model and the TTFT prediction that generate admission sheds on."""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from streams.policies.gen_admission import QueueState, StepCostModel, predict_ttft_ms, ttft_bound_ms


def test_the_cost_model_learns_a_linear_step_cost() -> None:
    model = StepCostModel()
    rng = np.random.default_rng(1)
    for _ in range(300):
        d, p = int(rng.integers(0, 9)), int(rng.integers(0, 200))
        model.observe(8.0 + 1.5 * d + 0.25 * p + rng.normal(0, 0.1), d, p)
    assert np.allclose(model.coef, [8.0, 1.5, 0.25], atol=0.3)
    assert abs(model.step_ms(4, 100) - (8 + 6 + 25)) < 1.5


def state(running=0, remaining=(), waiting_rt=0, tokens_rt=0, waiting_bulk=0, tokens_bulk=0) -> QueueState:
    return QueueState(running, 4, 64, tuple(remaining), {"rt": tokens_rt, "bulk": tokens_bulk},
                      {"rt": waiting_rt, "bulk": waiting_bulk})


def test_an_idle_core_predicts_one_prefill() -> None:
    model = StepCostModel(fixed_ms=10, per_decode_ms=1, per_prefill_token_ms=0.5)
    assert predict_ttft_ms(model, state(), 32, "rt") == 10 + 16


def test_no_free_slot_adds_the_wait_for_one_to_end() -> None:
    model = StepCostModel(fixed_ms=10, per_decode_ms=1, per_prefill_token_ms=0.5)
    full = state(running=4, remaining=(30, 5, 50, 40))
    assert predict_ttft_ms(model, full, 32, "rt") >= 5 * model.step_ms(4, 0)


def test_rt_does_not_wait_for_bulk_but_bulk_waits_for_rt() -> None:
    model = StepCostModel()
    s = state(waiting_rt=2, tokens_rt=100, waiting_bulk=10, tokens_bulk=2000)
    assert predict_ttft_ms(model, s, 10, "rt") < predict_ttft_ms(model, s, 10, "bulk")


@given(st.integers(0, 4), st.integers(0, 20), st.integers(0, 2000), st.integers(1, 500))
def test_more_queued_work_never_predicts_sooner(running, waiting, tokens, prompt) -> None:
    model = StepCostModel()
    base = state(running=running, remaining=(10,) * running, waiting_rt=waiting, tokens_rt=tokens)
    more = state(running=running, remaining=(10,) * running, waiting_rt=waiting + 1, tokens_rt=tokens + 50)
    assert predict_ttft_ms(model, more, prompt, "rt") >= predict_ttft_ms(model, base, prompt, "rt")


def test_bulk_is_held_to_ten_times_the_bound() -> None:
    assert ttft_bound_ms(1000, "rt") == 1000 and ttft_bound_ms(1000, "bulk") == 10_000 and ttft_bound_ms(0, "rt") == 0


def test_a_request_waits_for_kv_cells_as_well_as_for_slots() -> None:
    model = StepCostModel(fixed_ms=10, per_decode_ms=1, per_prefill_token_ms=0.5)
    roomy = QueueState(2, 8, 64, (5, 50), {}, {}, (1000, 1000), 0)
    tight = QueueState(2, 8, 64, (5, 50), {}, {}, (1000, 1000), 2500)
    assert predict_ttft_ms(model, roomy, 32, "rt", cells=600) == predict_ttft_ms(model, roomy, 32, "rt") < 5 * model.step_ms(2, 0)
    assert predict_ttft_ms(model, tight, 32, "rt", cells=600) >= 5 * model.step_ms(2, 0)  # one must end first
    assert predict_ttft_ms(model, tight, 32, "rt", cells=1600) >= 50 * model.step_ms(2, 0)  # both must


def test_retry_after_is_bounded() -> None:
    from streams.policies.gen_admission import MAX_RETRY_AFTER_MS, retry_after_ms

    assert retry_after_ms(1100, 1000) == 100 and retry_after_ms(10**9, 1000) == MAX_RETRY_AFTER_MS
