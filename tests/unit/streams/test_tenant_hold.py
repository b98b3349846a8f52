"""Holding a shed tenant's ingress (streams.policies.tenant_hold): for its retry-after, at
most the cap, released once, the longest hold kept."""

from __future__ import annotations

from streams.policies.tenant_hold import TenantHolds


def test_a_shed_tenant_is_held_for_its_retry_after_at_most_the_cap_then_released_once():
    h = TenantHolds(max_hold_ms=1_000.0)
    h.note_shed("a", 300, now_ms=0.0)
    h.note_shed("b", 60_000, now_ms=0.0)  # a long debt: held no longer than the cap
    assert h.due(100.0) == ({"a", "b"}, set())
    assert h.due(300.0) == ({"b"}, {"a"})
    assert h.due(400.0) == ({"b"}, set())  # released once
    assert h.due(1_000.0) == (set(), {"b"})
    assert "a" not in h and "b" not in h


def test_a_shorter_retry_after_does_not_cut_a_hold_short():
    h = TenantHolds(max_hold_ms=5_000.0)
    h.note_shed("a", 2_000, now_ms=0.0)
    h.note_shed("a", 100, now_ms=50.0)
    assert h.due(1_000.0) == ({"a"}, set())
    assert h.due(2_000.0) == (set(), {"a"})


def test_off_at_zero_and_for_no_retry_after():
    off = TenantHolds(max_hold_ms=0.0)
    off.note_shed("a", 500, now_ms=0.0)
    assert not off.enabled and off.due(1.0) == (set(), set())
    on = TenantHolds(max_hold_ms=1_000.0)
    on.note_shed("a", 0, now_ms=0.0)
    assert on.due(1.0) == (set(), set())
