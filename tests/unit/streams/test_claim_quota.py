"""The claim sweep's plan: TTLs capped, each tenant cut back to its quota newest first."""

from __future__ import annotations

from streams.policies.claim_quota import StoredClaim, plan_sweep


def c(key: str, tenant: str, nbytes: int, ttl: int) -> StoredClaim:
    return StoredClaim(f"mm:claim:{tenant}:{key}", tenant, nbytes, ttl)


def test_claims_without_an_expiry_or_with_a_longer_one_get_the_cap_and_the_rest_are_left():
    plan = plan_sweep([c("a", "t", 1, -1), c("b", "t", 1, 10_000), c("c", "t", 1, 60)], quota_bytes=0, max_ttl_s=3600)
    assert sorted(plan.expire) == [("mm:claim:t:a", 3600), ("mm:claim:t:b", 3600)]
    assert plan.delete == [] and plan.stored_bytes == {"t": 3}


def test_a_tenant_over_its_quota_loses_its_newest_claims_until_under_and_no_other_tenant_loses_any():
    claims = [c("old", "a", 40, 100), c("mid", "a", 40, 2000), c("new", "a", 40, 3500), c("forever", "a", 10, -1),
              c("x", "b", 500, 3000)]
    plan = plan_sweep(claims, quota_bytes=100, max_ttl_s=3600)
    # a holds 130: the one without expiry counts as newest, then 3500 s; 80 is under 100.
    assert [k for k in plan.delete if ":a:" in k] == ["mm:claim:a:forever", "mm:claim:a:new"]
    assert plan.deleted_bytes == {"a": 50, "b": 500}
    assert plan.stored_bytes["a"] == 80
    # b is over too (500 > 100), and is cut on its own account only.
    assert "mm:claim:b:x" in plan.delete and plan.stored_bytes["b"] == 0
    assert ("mm:claim:a:forever", 3600) not in plan.expire  # deleted, not expired


def test_exactly_at_the_quota_nothing_is_deleted():
    plan = plan_sweep([c("a", "t", 50, 10), c("b", "t", 50, 20)], quota_bytes=100, max_ttl_s=3600)
    assert plan.delete == [] and plan.deleted_bytes == {}
