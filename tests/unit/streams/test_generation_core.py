"""The generation core driven by ``step()`` alone, on a hand-built engine: no broker, no model.

The fake engine's logits put all mass on ``(last token + 1) % VOCAB``, so every sequence's
output is known in advance; it counts slots, so a leak of engine state shows.
"""

from __future__ import annotations

import numpy as np
import pytest

from streams.cores.generation import GenerationCore, GenerationRequest
from streams.policies.gen_admission import StepCostModel
from streams.policies.scheduler import ContinuousBatchScheduler, SchedulerLimits
from workers.engines.lm_types import LMError, LMSequence, SamplingParams

VOCAB = 32
EOS = 0


class FakeEngine:
    max_context = 64
    eos_token_ids = frozenset({EOS})

    def __init__(self, slots: int = 4) -> None:
        self.free = slots
        self.calls: list[list[tuple[str, int]]] = []
        self.fail_next = False
        self.refuse: set[str] = set()

    def new_sequence(self, seq_id, prompt, params, cache_scope=""):
        if seq_id in self.refuse:
            raise LMError(f"{seq_id} refused")
        assert self.free > 0, "more sequences admitted than the engine holds"
        self.free -= 1
        seq = LMSequence(seq_id, list(prompt), len(prompt), params, np.zeros(0))
        seq.state = "slot"
        return seq

    def forward(self, chunks):
        self.calls.append([(s.seq_id, n) for s, n in chunks])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("kernel fault")
        out = np.zeros((len(chunks), VOCAB), np.float32)
        for row, (seq, n) in enumerate(chunks):
            assert seq.state == "slot", "forward on a released sequence"
            seq.num_cached += n
            out[row, (seq.tokens[seq.num_cached - 1] + 1) % VOCAB] = 1.0
        return out

    def sample(self, seq, logits):
        return int(np.argmax(logits))

    def append(self, seq, token):
        seq.tokens.append(int(token))

    def release(self, seq):
        assert seq.state == "slot", "released twice"
        seq.state = None
        self.free += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def core(slots: int = 4, **limits) -> tuple[GenerationCore, FakeEngine, Clock]:
    engine, clock = FakeEngine(slots), Clock()
    scheduler = ContinuousBatchScheduler(SchedulerLimits(**{"max_running": slots, **limits}), engine.eos_token_ids)
    return GenerationCore(engine, scheduler, clock=clock), engine, clock


def request(key: str, prompt=(5, 6, 7), max_tokens: int = 3, lane: str = "rt", deadline=None) -> GenerationRequest:
    return GenerationRequest(key, tuple(prompt), SamplingParams(max_tokens=max_tokens), lane, 100.0, deadline)


def run(c: GenerationCore, limit: int = 50) -> list:
    updates = []
    for _ in range(limit):
        if not c.has_work:
            return updates
        updates += c.step()
    raise AssertionError("the core never ran out of work")


def test_each_request_ends_once_with_its_tokens_and_frees_its_state() -> None:
    c, engine, _ = core()
    c.submit(request("a", (5, 6, 7), max_tokens=3))
    c.submit(request("b", (30,), max_tokens=5))  # 30 -> 31 -> 0 (eos)
    updates = run(c)
    ends = {u.key: u for u in updates if u.finish_reason}
    assert sorted(ends) == ["a", "b"] and len([u for u in updates if u.finish_reason]) == 2
    assert (ends["a"].finish_reason, ends["a"].completion_tokens) == ("max_tokens", 3)
    assert (ends["b"].finish_reason, ends["b"].completion_tokens) == ("eos", 2)
    assert sum(u.new_tokens for u in updates if u.key == "a") == 3
    assert engine.free == 4


def test_prefill_and_decodes_share_one_engine_call_per_step() -> None:
    c, engine, _ = core()
    c.submit(request("a", max_tokens=4))
    c.step()  # a's prompt
    c.submit(request("b", max_tokens=2))
    c.step()
    assert engine.calls[1] == [("b", 3), ("a", 1)]  # b's prompt beside a's decode, in one forward


def test_waiting_requests_hold_no_engine_state() -> None:
    c, engine, _ = core(slots=1)
    for key in "abc":
        c.submit(request(key, max_tokens=2))
    c.step()
    assert engine.free == 0 and c.num_live == 3  # one admitted, two waiting without a slot
    run(c)
    assert engine.free == 1 and c.num_live == 0


def test_past_the_deadline_a_request_ends_deadline_exceeded() -> None:
    c, engine, clock = core()
    c.submit(request("late", max_tokens=10, deadline=101.0))
    c.step()
    clock.now = 102.0
    updates = c.step()
    assert [(u.key, u.finish_reason) for u in updates] == [("late", "deadline_exceeded")]
    assert engine.free == 4 and not c.has_work


def test_a_cancelled_request_ends_silently_and_frees_its_state() -> None:
    c, engine, _ = core()
    c.submit(request("a", max_tokens=10))
    c.step()
    c.cancel("a")
    assert c.step() == [] and engine.free == 4 and not c.has_work


def test_a_failed_step_fails_its_sequences_and_the_core_goes_on() -> None:
    c, engine, _ = core()
    c.submit(request("a", max_tokens=5))
    c.step()
    engine.fail_next = True
    failed = c.step()
    assert [(u.key, u.finish_reason, u.code) for u in failed] == [("a", "error", "internal")]
    assert "kernel fault" in failed[0].error and engine.free == 4
    c.submit(request("b", max_tokens=1))
    assert [u.finish_reason for u in run(c) if u.finish_reason] == ["max_tokens"]


def test_a_request_the_engine_refuses_ends_with_its_error() -> None:
    c, engine, _ = core()
    engine.refuse.add("bad")
    c.submit(request("bad"))
    c.submit(request("ok", max_tokens=1))
    ends = {u.key: u for u in run(c) if u.finish_reason}
    assert (ends["bad"].finish_reason, ends["bad"].code) == ("error", "invalid_request")
    assert ends["ok"].finish_reason == "max_tokens" and engine.free == 4


def test_requests_past_the_context_are_refused_at_submit() -> None:
    c, _, _ = core()
    with pytest.raises(LMError, match="exceeds the context"):
        c.submit(request("long", prompt=range(1, 60), max_tokens=10))
    with pytest.raises(LMError, match="empty"):
        c.check(0, SamplingParams())


def test_the_kv_budget_holds_admission_until_cells_free() -> None:
    c, engine, _ = core(slots=4, max_kv_tokens=12)
    for key in "ab":
        c.submit(request(key, prompt=(1, 2, 3), max_tokens=5))  # 8 cells each
    c.step()
    assert engine.free == 3  # b waits: 16 cells would be past 12
    run(c)
    assert engine.free == 4


def test_predicted_ttft_grows_with_the_queue_ahead() -> None:
    c, _, _ = core(slots=1, max_tokens_per_step=8)
    c.cost = StepCostModel(fixed_ms=10, per_decode_ms=1, per_prefill_token_ms=1)
    alone = c.predict_ttft_ms(8, "rt")
    for key in "abcd":
        c.submit(request(key, prompt=range(1, 9), max_tokens=20))
    assert c.predict_ttft_ms(8, "rt") > alone
    c.step()
    behind = c.predict_ttft_ms(8, "rt")
    assert behind > alone and c.predict_ttft_ms(8, "bulk") >= behind


def test_a_request_dropped_beside_running_ones_ends_once() -> None:
    c, engine, clock = core()
    c.submit(request("late", max_tokens=10, deadline=101.0))
    c.submit(request("on", max_tokens=4))
    c.step()
    clock.now = 102.0
    ends = [(u.key, u.finish_reason) for u in run(c) if u.finish_reason]
    assert ends == [("late", "deadline_exceeded"), ("on", "max_tokens")] and engine.free == 4


def test_a_cancel_then_a_new_submit_of_the_same_key_runs_the_new_one() -> None:
    c, engine, _ = core()
    c.submit(request("k", max_tokens=10))
    c.step()
    c.cancel("k")  # the partition was lost ...
    c.submit(request("k", max_tokens=2))  # ... and taken back before the next step
    ends = [(u.key, u.finish_reason, u.completion_tokens) for u in run(c) if u.finish_reason]
    assert ends == [("k", "max_tokens", 2)] and engine.free == 4 and c.num_live == 0


def test_a_duplicate_submit_ends_alone_and_the_rest_of_the_inbox_runs() -> None:
    c, engine, _ = core()
    c.submit(request("a", max_tokens=3))
    c.submit(request("a", max_tokens=3))
    c.submit(request("b", max_tokens=1))
    ends = sorted((u.key, u.finish_reason) for u in run(c) if u.finish_reason)
    assert ends == [("a", "error"), ("a", "max_tokens"), ("b", "max_tokens")] and c.num_live == 0


def test_the_static_scheduler_runs_through_the_core() -> None:
    from streams.policies.scheduler import StaticBatchScheduler

    engine = FakeEngine(2)
    c = GenerationCore(engine, StaticBatchScheduler(SchedulerLimits(max_running=2), engine.eos_token_ids))
    for key in "abc":
        c.submit(request(key, max_tokens=2))
    assert sorted(u.key for u in run(c) if u.finish_reason) == ["a", "b", "c"] and engine.free == 2


def test_calibration_measures_every_shape_even_with_one_slot() -> None:
    from streams.cores.generation import calibrate

    c, engine, _ = core(slots=1)
    before = c.cost.observed
    calibrate(c)
    assert c.cost.observed > before and engine.free == 1
