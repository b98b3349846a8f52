"""The cost-weighted fair order (streams.policies.fair_order): tenants share engine time by
cost, an idle tenant starts right behind the work in service, nothing starves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streams.policies.fair_order import MAX_TENANTS, FairOrder


def order() -> FairOrder[tuple[str, float, tuple[float, int]]]:
    return FairOrder(key=lambda it: it[2])


def push(q: FairOrder, tenant: str, cost: float) -> None:
    q.push((tenant, cost, q.tag(tenant, cost)))


def take(q: FairOrder, n: int = 1) -> list[str]:
    batch, q.items[:] = q.items[:n], q.items[n:]
    q.taken([it[2] for it in batch])
    return [it[0] for it in batch]


def test_a_late_cheap_tenant_goes_ahead_of_a_costly_backlog() -> None:
    q = order()
    for _ in range(20):
        push(q, "a", 100.0)  # 2 s of A's work queued
    assert take(q) == ["a"]
    push(q, "b", 5.0)
    assert take(q) == ["b"]  # right behind the one of A's in service, not behind A's 19


def test_two_busy_tenants_share_engine_time_by_cost_not_by_count() -> None:
    q = order()
    for _ in range(40):
        push(q, "a", 100.0)
    for _ in range(400):
        push(q, "b", 10.0)
    served = {"a": 0.0, "b": 0.0}
    cost = {"a": 100.0, "b": 10.0}
    for _ in range(150):
        (t,) = take(q)
        served[t] += cost[t]
    assert abs(served["a"] - served["b"]) <= 100.0  # within one of A's items


def test_one_tenant_alone_is_served_in_arrival_order() -> None:
    q = order()
    for i in range(10):
        q.push(("a", float(i), q.tag("a", 1.0 + i)))
    assert [it[1] for it in q.items] == [float(i) for i in range(10)]


def test_an_idle_tenant_earns_no_credit() -> None:
    q = order()
    push(q, "b", 1.0)
    take(q)
    for _ in range(10):
        push(q, "a", 10.0)
    take(q, 5)  # A is served for a while; B was idle
    for _ in range(10):
        push(q, "b", 10.0)
    names = take(q, 6)
    assert names.count("b") <= 4  # interleaved with A, not all of B's first


def test_finish_tags_are_bounded() -> None:
    q = order()
    for i in range(MAX_TENANTS + 10):
        push(q, f"t{i}", 1.0)
        take(q)
    assert len(q._finish) <= MAX_TENANTS + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0.0, 100.0), st.integers(0, 3)), max_size=60))
def test_every_item_is_taken_and_a_tenants_items_keep_their_order(ops) -> None:
    q = order()
    pushed: dict[str, list[int]] = {}
    seen: dict[str, list[int]] = {}
    n = 0
    for tenant, cost, takes in ops:
        q.push((tenant, n, q.tag(tenant, cost)))
        pushed.setdefault(tenant, []).append(n)
        n += 1
        for _ in range(takes):
            if q.items:
                it = q.items.pop(0)
                q.taken([it[2]])
                seen.setdefault(it[0], []).append(it[1])
    while q.items:
        it = q.items.pop(0)
        q.taken([it[2]])
        seen.setdefault(it[0], []).append(it[1])
    assert seen == pushed
