from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import ErrorCode
from streams.policies.admission import IDLE_SHARE, AdmissionLimits, Admit, Backpressure, Reject, admit

LIMITS = AdmissionLimits(max_queued_ms_rt=1000, max_queued_ms_bulk=200)


def test_bulk_is_shed_before_rt():
    queued = {"encode.text": 500.0}
    assert isinstance(admit(lane="rt", stages={"encode.text": 5}, queued_ms=queued, deadline_ms=30_000, limits=LIMITS), Admit)
    r = admit(lane="bulk", stages={"encode.text": 5}, queued_ms=queued, deadline_ms=30_000, limits=LIMITS)
    assert isinstance(r, Reject) and r.code == ErrorCode.OVERLOADED and r.retry_after_ms >= 300


def test_a_deadline_that_cannot_be_met_is_rejected_early():
    r = admit(lane="rt", stages={"encode.image": 50}, queued_ms={"encode.image": 400}, deadline_ms=100, limits=LIMITS)
    assert isinstance(r, Reject) and r.code == ErrorCode.DEADLINE_EXCEEDED and r.retry_after_ms is None


@given(lane=st.sampled_from(["rt", "bulk"]),
       queued=st.dictionaries(st.sampled_from(["encode.text", "encode.image", "encode.video"]),
                              st.floats(0, 5000), max_size=3),
       needs=st.lists(st.sampled_from(["encode.text", "encode.image", "encode.video"]), min_size=1, unique=True))
def test_never_admits_into_a_stage_past_its_lane_limit(lane, queued, needs):
    decision = admit(lane=lane, stages={s: 1.0 for s in needs}, queued_ms=queued, deadline_ms=1e9, limits=LIMITS)
    limit = LIMITS.max_queued_ms_rt if lane == "rt" else LIMITS.max_queued_ms_bulk
    if isinstance(decision, Admit):
        assert all(queued.get(s, 0.0) + 1.0 <= limit or queued.get(s, 0.0) < IDLE_SHARE * limit for s in needs)
    else:
        assert decision.code == ErrorCode.OVERLOADED and any(queued.get(s, 0.0) + 1.0 > limit for s in needs)
        assert decision.stage in needs and queued.get(decision.stage, 0.0) + 1.0 > limit  # which queue refused it


def test_one_costly_request_is_not_admitted_past_the_bound_it_would_break():
    # 2.4 s of text work (16 parts of 64 KiB) into a queue of 300 ms with a 1 s rt limit.
    r = admit(lane="rt", stages={"encode.text": 2400}, queued_ms={"encode.text": 300}, deadline_ms=1e9, limits=LIMITS)
    assert isinstance(r, Reject) and r.code == ErrorCode.OVERLOADED and r.retry_after_ms >= 1700
    # A cheap one still fits beside it, and the costly one gets in on a nearly idle stage.
    assert isinstance(admit(lane="rt", stages={"encode.text": 20}, queued_ms={"encode.text": 300}, deadline_ms=1e9,
                            limits=LIMITS), Admit)
    assert isinstance(admit(lane="rt", stages={"encode.text": 2400}, queued_ms={"encode.text": 10}, deadline_ms=1e9,
                            limits=LIMITS), Admit)


@given(queued=st.dictionaries(st.sampled_from(["a", "b"]), st.floats(0, 5000), max_size=2))
def test_rt_is_admitted_whenever_bulk_is(queued):
    args = dict(stages={"a": 1.0, "b": 1.0}, queued_ms=queued, deadline_ms=1e9, limits=LIMITS)
    if isinstance(admit(lane="bulk", **args), Admit):
        assert isinstance(admit(lane="rt", **args), Admit)


def test_backpressure_has_hysteresis():
    bp = Backpressure(high_ms=100, low_ms=20)
    assert [bp.update(q) for q in (50, 150, 80, 30, 10, 50)] == [None, "pause", None, None, "resume", None]
