"""Generation scheduler: limits per step, one terminal state per sequence, rt before bulk.

The model is simulated: a step's tokens are drawn by the test (Hypothesis), so the policy
is checked on the CPU without any engine.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.policies.scheduler import (
    FINISH_REASON,
    TERMINAL,
    ContinuousBatchScheduler,
    SchedulerError,
    SchedulerLimits,
    SequenceRequest,
    SequenceStatus,
    StaticBatchScheduler,
    StepOutput,
)

EOS = 2


def req(seq_id: str, prompt: int = 4, max_tokens: int = 3, lane: str = "rt", at: float = 0.0,
        deadline: float | None = None, cached: int = 0) -> SequenceRequest:
    return SequenceRequest(seq_id, prompt, max_tokens, lane, at, deadline, cached)


def owed(out) -> list[str]:
    return list(out.decode) + [c.seq_id for c in out.prefill if c.is_last]


def run_step(s, now: float, token: int = 7, stopped: frozenset[str] = frozenset()):
    out = s.schedule(now)
    return out, s.update(StepOutput({i: token for i in owed(out)}, stopped))


def test_prefill_then_decode_until_max_tokens() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits(max_tokens_per_step=64), eos_token_ids=[EOS])
    s.add(req("a", prompt=5, max_tokens=3))
    out, fin = run_step(s, 1.0)
    assert out.prefill[0].num_tokens == 5 and out.prefill[0].is_last and out.num_tokens == 5
    assert s.status("a") is SequenceStatus.DECODING and fin == []
    out, fin = run_step(s, 2.0)
    assert out.decode == ("a",) and out.num_tokens == 1 and fin == []
    _, fin = run_step(s, 3.0)
    assert [(f.seq_id, f.reason, f.tokens) for f in fin] == [("a", "max_tokens", (7, 7, 7))]
    assert [(st.value, t) for st, t in fin[0].history] == [
        ("waiting", 0.0), ("prefilling", 1.0), ("decoding", 1.0), ("finished_length", 3.0)]
    assert not s.has_work


def test_eos_and_stop_strings_end_a_sequence() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits(), eos_token_ids=[EOS])
    s.add(req("a", max_tokens=10))
    s.add(req("b", max_tokens=10))
    run_step(s, 0.0)  # prefill both
    s.schedule(1.0)
    fin = s.update(StepOutput({"a": EOS, "b": 5}, frozenset({"b"})))
    assert {f.seq_id: f.reason for f in fin} == {"a": "eos", "b": "stop"}


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits(max_tokens_per_step=8, max_prefill_chunk=8))
    s.add(req("short", prompt=3, max_tokens=50))
    run_step(s, 0.0)
    s.add(req("long", prompt=20, at=0.5))
    out, _ = run_step(s, 1.0)
    assert out.decode == ("short",)
    assert [(c.seq_id, c.start, c.num_tokens, c.is_last) for c in out.prefill] == [("long", 0, 7, False)]
    out, _ = run_step(s, 2.0)
    assert [(c.start, c.num_tokens, c.is_last) for c in out.prefill] == [(7, 7, False)]
    out, _ = run_step(s, 3.0)
    assert [(c.start, c.num_tokens, c.is_last) for c in out.prefill] == [(14, 6, True)]


def test_prefix_cached_tokens_are_not_scheduled() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits())
    s.add(req("a", prompt=40, cached=32))
    out = s.schedule(0.0)
    assert [(c.start, c.num_tokens) for c in out.prefill] == [(32, 8)]


def test_deadline_drops_waiting_and_running() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits(max_running=1))
    s.add(req("run", max_tokens=10, deadline=5.0))
    s.add(req("wait", deadline=2.0))
    run_step(s, 1.0)
    out, fin = run_step(s, 3.0)
    assert out.dropped == (("wait", "deadline_exceeded"),)
    assert [(f.seq_id, f.status) for f in fin] == [("wait", SequenceStatus.DROPPED_DEADLINE)]
    out, fin = run_step(s, 6.0)
    assert out.dropped == (("run", "deadline_exceeded"),) and out.is_empty
    assert not s.has_work


def test_static_batches_do_not_admit_until_the_batch_is_done() -> None:
    s = StaticBatchScheduler(SchedulerLimits(max_running=2))
    s.add(req("a", max_tokens=1))
    s.add(req("b", max_tokens=3))
    s.add(req("c", max_tokens=1))
    out, _ = run_step(s, 0.0)  # a finishes at once (max_tokens 1); b keeps the batch open
    assert {c.seq_id for c in out.prefill} == {"a", "b"}
    out, _ = run_step(s, 1.0)
    assert out.prefill == () and out.decode == ("b",)
    run_step(s, 2.0)
    out, _ = run_step(s, 3.0)
    assert [c.seq_id for c in out.prefill] == ["c"]


def test_contract_errors() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits())
    with pytest.raises(SchedulerError):
        s.add(req("x", lane="batch"))
    with pytest.raises(SchedulerError):
        s.add(req("x", prompt=4, cached=4))
    s.add(req("a"))
    with pytest.raises(SchedulerError):
        s.add(req("a"))
    s.schedule(0.0)
    with pytest.raises(SchedulerError):
        s.schedule(0.0)
    with pytest.raises(SchedulerError):
        s.update(StepOutput({}))  # "a" was owed a token
    with pytest.raises(SchedulerError):
        SchedulerLimits(max_running=0)


def test_abort_is_a_terminal_state_with_a_reason() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits())
    s.add(req("a"))
    fin = s.abort("a", 1.0)
    assert fin is not None and fin.reason == "aborted" and s.abort("a", 2.0) is None
    assert set(FINISH_REASON) == TERMINAL


# -- properties ---------------------------------------------------------------------------

request_st = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(1, 40),  # prompt tokens
    st.integers(1, 6),  # max_tokens
    st.sampled_from(["rt", "bulk"]),
    st.one_of(st.none(), st.integers(0, 30)),  # deadline, in steps
)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request_st, min_size=1, max_size=12),
    budget=st.integers(1, 24),
    max_running=st.integers(1, 5),
    chunk=st.integers(1, 16),
    static=st.booleans(),
    data=st.data(),
)
def test_limits_terminal_states_and_lane_order(requests, budget, max_running, chunk, static, data) -> None:
    limits = SchedulerLimits(max_tokens_per_step=budget, max_running=max_running, max_prefill_chunk=chunk)
    s = (StaticBatchScheduler if static else ContinuousBatchScheduler)(limits, eos_token_ids=[EOS])
    endings: dict[str, list[str]] = {}
    lane_of = {f"r{i}": r[3] for i, r in enumerate(requests)}
    for step in range(2000):
        for i, (arrive, prompt, max_tokens, lane, deadline) in enumerate(requests):
            if arrive == step:
                s.add(req(f"r{i}", prompt, max_tokens, lane, float(step),
                          None if deadline is None else float(deadline)))
        if step > 6 and not s.has_work:
            break
        waiting = {i for i in lane_of if s.status(i) is SequenceStatus.WAITING}
        out = s.schedule(float(step))
        # Limits.
        assert out.num_tokens == len(out.decode) + sum(c.num_tokens for c in out.prefill) <= budget
        assert s.num_running <= max_running
        assert all(1 <= c.num_tokens <= chunk for c in out.prefill)
        scheduled = list(out.decode) + [c.seq_id for c in out.prefill]
        assert len(scheduled) == len(set(scheduled))
        # rt before bulk: bulk work only when no rt sequence was left out by the budget.
        if any(lane_of[i] == "bulk" for i in scheduled):
            running_rt = [i for i in lane_of if lane_of[i] == "rt" and s.status(i) in
                          (SequenceStatus.PREFILLING, SequenceStatus.DECODING)]
            assert set(running_rt) <= set(scheduled)
        # A bulk sequence is never admitted while an rt one stays waiting.
        admitted = waiting & {c.seq_id for c in out.prefill}
        if any(lane_of[i] == "bulk" for i in admitted):
            assert not any(lane_of[i] == "rt" and s.status(i) is SequenceStatus.WAITING for i in waiting)
        # Decisions follow lane order: every rt item comes before every bulk item in each list.
        for ids in (list(out.decode), [c.seq_id for c in out.prefill]):
            lanes = [lane_of[i] for i in ids]
            assert lanes == sorted(lanes, key=["rt", "bulk"].index)
        tokens = {i: data.draw(st.sampled_from([EOS, 5, 6]), label="token") for i in owed(out)}
        stopped = frozenset(i for i in tokens if data.draw(st.booleans(), label="stop") and tokens[i] == 6)
        for fin in s.update(StepOutput(tokens, stopped)):
            assert fin.status in TERMINAL and fin.reason == FINISH_REASON[fin.status]
            endings.setdefault(fin.seq_id, []).append(fin.reason)
            assert len(fin.tokens) <= requests[int(fin.seq_id[1:])][2]
    assert not s.has_work
    # Every admitted sequence ends exactly once, with a reason.
    assert set(endings) == set(lane_of)
    assert all(len(reasons) == 1 for reasons in endings.values())


def test_the_kv_budget_holds_admission_and_bulk_never_jumps_a_waiting_rt() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits(max_running=8, max_kv_tokens=20), [EOS])
    s.add(req("bulk-big", prompt=4, max_tokens=10, lane="bulk"))
    run_step(s, 0.0)
    s.add(req("rt", prompt=4, max_tokens=10))  # 14 more cells: past the 20
    s.add(req("bulk-small", prompt=1, max_tokens=1, lane="bulk"))  # 2 cells would fit
    out, _ = run_step(s, 1.0)
    assert [c.seq_id for c in out.prefill] == [] and s.num_running == 1  # both wait
    for t in range(2, 20):
        run_step(s, float(t))
    assert s.status("rt") is None and s.status("bulk-small") is None  # both ran once cells freed


def test_on_admit_sets_the_cached_prompt_or_ends_a_refused_sequence() -> None:
    s = ContinuousBatchScheduler(SchedulerLimits(), [EOS])
    s.add(req("hit", prompt=10))
    s.add(req("refused", prompt=4))
    out = s.schedule(0.0, on_admit=lambda sid: 6 if sid == "hit" else None)
    assert [(c.seq_id, c.start, c.num_tokens) for c in out.prefill] == [("hit", 6, 4)]
    assert out.dropped == (("refused", "aborted"),)
