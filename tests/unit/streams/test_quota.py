"""Per-tenant quotas (streams.policies.quota): the token bucket, the queued-work counts,
fair share only under contention, bounded memory and a bounded metric label."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streams.policies.quota import QuotaLimits, TenantLabels, TenantQuotas

LANE = 5_000.0  # the rt lane's admission limit (ms)


def quotas(**kw) -> TenantQuotas:
    return TenantQuotas(QuotaLimits(**{"fair_share": 0.0, **kw}))


def test_off_by_default_for_rate_and_absolute_work():
    q = TenantQuotas(QuotaLimits())
    assert q.enabled  # fair share is on by default
    for i in range(1000):
        assert q.check("solo", lane_limit_ms=LANE, now_ms=float(i)) is None
        q.note_sent("solo", 100.0, float(i))  # a tenant alone may fill the pool
    off = quotas()
    assert not off.enabled
    for i in range(100):  # with no quota set the router's notes keep no state
        off.note_sent(f"t{i}", 100.0, float(i))
        off.note_refused(f"t{i}", float(i))
    assert len(off) == 0


def test_rate_sheds_past_the_burst_and_says_when_a_token_is_back():
    q = quotas(rate_per_s=2.0, burst=3.0)
    assert [q.check("a", lane_limit_ms=LANE, now_ms=0.0) for _ in range(3)] == [None] * 3
    shed = q.check("a", lane_limit_ms=LANE, now_ms=0.0)
    assert shed is not None and shed.reason == "rate" and shed.retry_after_ms == 500
    assert q.check("a", lane_limit_ms=LANE, now_ms=499.0) is not None
    assert q.check("a", lane_limit_ms=LANE, now_ms=500.0) is None
    assert q.check("b", lane_limit_ms=LANE, now_ms=500.0) is None  # another tenant has its own bucket


def test_overrides_give_a_tenant_its_own_rate():
    q = quotas(rate_per_s=1.0, overrides={"big": (100.0, 100.0)})
    assert sum(q.check("big", lane_limit_ms=LANE, now_ms=0.0) is None for _ in range(150)) == 100
    assert sum(q.check("small", lane_limit_ms=LANE, now_ms=0.0) is None for _ in range(5)) == 1


def test_absolute_queued_work_sheds_until_it_is_predicted_done():
    q = quotas(max_queued_ms=1_000.0, window_ms=10_000.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0) is None
    q.note_sent("a", 600.0, 0.0, wait_ms=4_000.0)  # done by 4.6 s: counted until its slot ends at 5 s
    q.note_sent("a", 600.0, 3_000.0, wait_ms=4_000.0)  # done by 7.6 s
    shed = q.check("a", lane_limit_ms=LANE, now_ms=4_000.0)
    assert shed is not None and shed.reason == "queued"
    assert shed.retry_after_ms == 1_000  # at 5 s the first 600 ms are done: 600 < 1000
    assert q.check("a", lane_limit_ms=LANE, now_ms=5_000.0) is None
    assert q.sent_ms("a", 5_000.0) == 600.0 and q.sent_ms("a", 8_000.0) == 0.0
    q.note_sent("a", 50_000.0, 8_000.0)  # a huge job counts one window at most
    assert q.sent_ms("a", 17_999.0) == 50_000.0 and q.sent_ms("a", 19_000.0) == 0.0


def test_fair_share_holds_back_only_the_tenants_that_need_the_stage_another_is_kept_out_of():
    """A tenant refused for the audio pool's queue holds back no one whose requests never go
    there (a tenant sending texts and photos, at 20 a second, was shed `queued` beside a flood of
    audio): only those whose request needs that stage; a refusal that names no stage, everyone."""
    q = quotas(fair_share=0.5, window_ms=10_000.0)
    q.note_sent("b", 4_000.0, 0.0, wait_ms=5_000.0)  # over half the lane's limit, in flight
    q.note_refused("a", 100.0, "encode.audio")
    assert q.check("b", lane_limit_ms=LANE, now_ms=200.0, stages={"encode.text", "encode.image"}) is None
    shed = q.check("b", lane_limit_ms=LANE, now_ms=300.0, stages={"encode.audio"})
    assert shed is not None and shed.reason == "queued"
    q.note_refused("a", 400.0, "encode.image")
    assert q.check("b", lane_limit_ms=LANE, now_ms=500.0, stages={"encode.text", "encode.image"}) is not None
    assert q.check("b", lane_limit_ms=LANE, now_ms=600.0, stages={"encode.text"}) is None
    q.note_refused("c", 700.0)  # no stage said: every stage is contended
    assert q.check("b", lane_limit_ms=LANE, now_ms=800.0, stages={"encode.text"}) is not None
    assert q.check("b", lane_limit_ms=LANE, now_ms=900.0) is not None  # a request that says no stages: any


def test_fair_share_applies_only_while_another_tenant_is_kept_out():
    q = quotas(fair_share=0.5, window_ms=10_000.0)
    q.check("hog", lane_limit_ms=LANE, now_ms=0.0)
    q.note_sent("hog", 4_000.0, 0.0, wait_ms=5_000.0)
    assert q.check("hog", lane_limit_ms=LANE, now_ms=100.0) is None  # alone: no limit but admission's
    assert q.check("small", lane_limit_ms=LANE, now_ms=200.0) is None  # a newcomer that gets in
    assert q.check("hog", lane_limit_ms=LANE, now_ms=250.0) is None  # changes nothing
    q.note_refused("small", 300.0)  # ... until admission turns it away: the pool is full
    shed = q.check("hog", lane_limit_ms=LANE, now_ms=400.0)
    assert shed is not None and shed.reason == "queued" and "2500" in shed.message
    assert q.check("small", lane_limit_ms=LANE, now_ms=500.0) is None  # under its share: may try again
    q.note_refused("hog", 600.0)  # its own refusals do not count against it
    assert q.check("hog", lane_limit_ms=LANE, now_ms=700.0) is not None
    # A window after the newcomer's last refusal, the hog is unconstrained again (its work still counted).
    q.note_sent("hog", 4_000.0, 9_000.0, wait_ms=5_000.0)
    assert q.sent_ms("hog", 10_500.0) == 4_000.0
    assert q.check("hog", lane_limit_ms=LANE, now_ms=10_500.0) is None


def test_idle_tenants_are_forgotten_and_memory_is_bounded():
    q = quotas(rate_per_s=10.0, burst=10.0, window_ms=1_000.0, max_tenants=50)
    for i in range(500):
        q.check(f"t{i}", lane_limit_ms=LANE, now_ms=0.0)
    assert len(q) == 50
    q.check("late", lane_limit_ms=LANE, now_ms=5_000.0)  # everyone else is idle, bucket full again
    assert len(q) == 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 50), st.floats(0, 500)), max_size=60))
def test_a_tenant_never_sends_more_than_its_rate_allows(events):
    """Over any run, admitted requests <= burst + rate x elapsed, per tenant."""
    q = quotas(rate_per_s=5.0, burst=2.0)
    now, admitted = 0.0, {"a": 0, "b": 0, "c": 0}
    for tenant, step_ms, cost in events:
        now += step_ms
        if q.check(tenant, lane_limit_ms=LANE, now_ms=now) is None:
            admitted[tenant] += 1
            q.note_sent(tenant, cost, now)
    for n in admitted.values():
        assert n <= 2 + 5.0 * now / 1000.0 + 1e-9


def test_labels_name_a_bounded_set_then_other():
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", "b", "c", "a", "other", "d")] == ["a", "b", "other", "a", "other", "other"]
    assert TenantLabels(0)("a") == "other"


def test_ref_bytes_are_a_bucket_of_their_own():
    q = quotas(ref_bytes_per_s=1000.0, ref_bytes_burst=2000.0)
    assert q.enabled
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=1500) is None
    shed = q.check("a", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=1000)
    assert shed is not None and shed.reason == "ref_bytes" and shed.retry_after_ms == 500
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0) is None  # requests without refs are not held back
    assert q.check("b", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=2000) is None  # each tenant its own bucket
    assert q.check("a", lane_limit_ms=LANE, now_ms=500.0, ref_bytes=1000) is None


def test_a_request_bigger_than_the_byte_bucket_waits_for_a_full_one_and_leaves_debt():
    q = quotas(ref_bytes_per_s=1000.0, ref_bytes_burst=1000.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=3000) is None  # full bucket: in, 2000 in debt
    shed = q.check("a", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=1)
    assert shed is not None and shed.retry_after_ms == 2001
    assert q.check("a", lane_limit_ms=LANE, now_ms=2001.0, ref_bytes=1) is None


def test_a_rate_shed_takes_no_bytes():
    q = quotas(rate_per_s=1.0, burst=1.0, ref_bytes_per_s=1000.0, ref_bytes_burst=1000.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=10) is None
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, ref_bytes=990).reason == "rate"
    assert q.check("a", lane_limit_ms=LANE, now_ms=1000.0, ref_bytes=990) is None  # the 990 bytes were kept


def test_compute_is_taken_when_sent_and_sheds_until_enough_is_back():
    q = quotas(compute_ms_per_s=100.0, compute_burst_ms=300.0)
    assert q.enabled
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=250.0) is None
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=250.0) is None  # not sent (admission refused): free
    q.note_sent("a", 250.0, 0.0)
    shed = q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=100.0)
    assert shed is not None and shed.reason == "compute" and shed.retry_after_ms == 500  # 50 left, 100 needed
    assert "100 engine ms per second" in shed.message
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=40.0) is None  # a smaller one still fits
    assert q.check("b", lane_limit_ms=LANE, now_ms=0.0, cost_ms=300.0) is None  # each tenant its own bucket
    assert q.check("a", lane_limit_ms=LANE, now_ms=500.0, cost_ms=100.0) is None


def test_a_request_priced_over_the_compute_bucket_waits_for_a_full_one_and_leaves_debt():
    q = quotas(compute_ms_per_s=100.0, compute_burst_ms=200.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=30_000.0) is None  # a long generation: in
    q.note_sent("a", 30_000.0, 0.0)  # 29,800 ms in debt: about five minutes of its rate
    shed = q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=10.0)
    assert shed is not None and shed.retry_after_ms == 298_100
    q.check("x", lane_limit_ms=LANE, now_ms=200_000.0)  # others seen later do not make it forget the debt
    assert q.check("a", lane_limit_ms=LANE, now_ms=298_000.0, cost_ms=10.0) is not None
    assert q.check("a", lane_limit_ms=LANE, now_ms=298_100.0, cost_ms=10.0) is None


def test_work_not_done_is_given_back_up_to_a_full_bucket():
    q = quotas(compute_ms_per_s=100.0, compute_burst_ms=200.0)
    assert q.charges_compute and q.over_bucket(201.0) and not q.over_bucket(200.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=30_000.0) is None
    q.note_sent("a", 30_000.0, 0.0)  # a generation charged for all its max_tokens
    q.refund("a", 29_000.0, 0.0)  # it stopped early: most of it given back
    shed = q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=10.0)
    assert shed is not None and shed.retry_after_ms == 8_100  # 800 ms in debt, not 29,800
    q.refund("a", 1e9, 0.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=200.0) is None  # full, never past it
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=201.0) is None  # debt: a full bucket, no more
    q.note_sent("a", 200.0, 0.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=1.0) is not None
    q.refund("nobody", 500.0, 0.0)
    assert len(q) == 1  # a tenant not held is not made up for a refund
    off = quotas(rate_per_s=5.0)
    assert not off.charges_compute and not off.over_bucket(1e9)


def test_a_shed_by_one_bucket_loses_no_refill_of_the_others():
    q = quotas(rate_per_s=1.0, burst=1.0, compute_ms_per_s=100.0, compute_burst_ms=100.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=100.0) is None
    q.note_sent("a", 100.0, 0.0)
    assert q.check("a", lane_limit_ms=LANE, now_ms=600.0, cost_ms=100.0).reason == "compute"
    assert q.check("a", lane_limit_ms=LANE, now_ms=1000.0, cost_ms=100.0) is None  # both full again at 1 s


def test_without_debt_a_request_priced_over_the_compute_bucket_is_refused_for_good():
    q = quotas(compute_ms_per_s=100.0, compute_burst_ms=200.0, compute_debt=False)
    refused = q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=201.0)
    assert refused is not None and refused.reason == "compute" and refused.retry_after_ms is None
    assert "split it" in refused.message
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=200.0) is None  # the burst itself fits


def test_a_request_answered_whole_from_the_cache_takes_only_its_rate_token():
    q = TenantQuotas(QuotaLimits(rate_per_s=1.0, burst=2.0, compute_ms_per_s=10.0, max_queued_ms=5.0))
    assert q.check("t", lane_limit_ms=500.0, now_ms=0.0, cost_ms=1000.0) is None
    q.note_sent("t", 1000.0, 0.0)  # in compute debt, and over its queued work
    assert q.check("t", lane_limit_ms=500.0, now_ms=1.0, cost_ms=1.0).reason == "queued"
    assert q.check_rate("t", now_ms=1.0) is None  # the second token of the burst
    shed = q.check_rate("t", now_ms=2.0)
    assert shed is not None and shed.reason == "rate" and shed.retry_after_ms > 0


def test_a_shed_no_price_can_change_is_known_before_the_request_is_priced():
    q = quotas(rate_per_s=2.0, burst=2.0, compute_ms_per_s=100.0, compute_burst_ms=200.0, ref_bytes_per_s=1000.0)
    pre = dict(now_ms=0.0, has_refs=True, costs_work=True)
    assert q.precheck("new", **pre) is None  # full buckets: price it
    assert q.check("a", lane_limit_ms=LANE, now_ms=0.0, cost_ms=30_000.0, ref_bytes=5000) is None
    q.note_sent("a", 30_000.0, 0.0)  # in debt for compute (29,800 ms) and ref bytes (4,000)
    shed = q.precheck("a", **pre)
    assert shed is not None and shed.reason == "ref_bytes" and shed.retry_after_ms == 4001
    shed = q.precheck("a", now_ms=0.0, has_refs=False, costs_work=True)
    assert shed.reason == "compute" and shed.retry_after_ms == 298_001 and "29800 ms owed" in shed.message
    assert q.precheck("a", now_ms=0.0, has_refs=False, costs_work=False) is None  # the cache may answer it whole
    assert q.check_rate("a", now_ms=0.0) is None  # it did: the second of two tokens
    shed = q.precheck("a", now_ms=0.0, has_refs=False, costs_work=False)
    assert shed.reason == "rate" and shed.retry_after_ms == 500
    assert q.precheck("a", now_ms=500.0, has_refs=False, costs_work=False) is None  # a token is back; nothing taken
    assert q.precheck("a", now_ms=500.0, has_refs=False, costs_work=False) is None
    assert quotas(max_queued_ms=10.0).precheck("a", **pre) is None
    busy = quotas(max_queued_ms=100.0)
    busy.check("a", lane_limit_ms=LANE, now_ms=0.0)
    busy.note_sent("a", 150.0, 0.0)
    assert busy.precheck("a", **pre).reason == "queued"
