import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.policies.batching import Batch, BatchLimits, MicroBatcher, Pending, Wait, padded_cost


def pend(i, cost=1.0, at=0.0):
    return Pending(i, cost, at)


def test_waits_for_company_until_max_wait_then_goes():
    b = MicroBatcher(BatchLimits(max_batch_size=4, max_wait_s=0.01))
    rt = [pend(1, at=0.0)]
    assert b.next_batch(rt, [], now=0.005) == Wait(0.01)
    batch = b.next_batch(rt, [], now=0.01)
    assert isinstance(batch, Batch) and [p.item for p in batch.items] == [1]


def test_full_batch_goes_at_once_and_never_exceeds_size():
    b = MicroBatcher(BatchLimits(max_batch_size=3, max_wait_s=10))
    batch = b.next_batch([pend(i) for i in range(5)], [], now=0.0)
    assert [p.item for p in batch.items] == [0, 1, 2]


def test_token_budget_keeps_one_long_item_from_inflating_a_batch():
    b = MicroBatcher(BatchLimits(max_batch_size=8, max_wait_s=10, max_batch_cost=100))
    queue = [pend(0, 10), pend(1, 10), pend(2, 90), pend(3, 10)]
    batch = b.next_batch(queue, [], now=0.0)
    assert [p.item for p in batch.items] == [0, 1]  # adding 90 would make 3 x 90 = 270
    alone = b.next_batch([pend(9, 500)], [], now=0.0)
    assert [p.item for p in alone.items] == [9]  # over budget alone still runs (alone)


def test_rt_goes_before_bulk_and_bulk_is_not_starved():
    b = MicroBatcher(BatchLimits(max_batch_size=1, max_wait_s=0), rt_burst=2)
    rt = [pend(f"r{i}") for i in range(10)]
    bulk = [pend(f"b{i}") for i in range(10)]
    order = []
    for _ in range(6):
        batch = b.next_batch(rt, bulk, now=1.0)
        (rt if batch.lane == "rt" else bulk).pop(0)
        order.append(batch.lane)
    assert order == ["rt", "rt", "bulk", "rt", "rt", "bulk"]


def test_idle_returns_none_and_limits_are_checked():
    assert MicroBatcher(BatchLimits()).next_batch([], [], 0.0) is None
    with pytest.raises(ValueError):
        BatchLimits(max_batch_size=0)


@settings(max_examples=200)
@given(costs=st.lists(st.integers(1, 200), min_size=1, max_size=40), size=st.integers(1, 16),
       budget=st.integers(1, 2000), now=st.floats(0, 1))
def test_batch_within_limits_and_in_arrival_order(costs, size, budget, now):
    b = MicroBatcher(BatchLimits(max_batch_size=size, max_wait_s=0.5, max_batch_cost=budget))
    queue = [pend(i, c, at=0.0) for i, c in enumerate(costs)]
    d = b.next_batch(queue, [], now)
    if isinstance(d, Wait):
        assert now < 0.5
        return
    items = [p.item for p in d.items]
    assert items == list(range(len(items))) and 1 <= len(items) <= size
    assert len(items) == 1 or padded_cost([p.cost for p in d.items]) <= budget


def lengths(*costs, at=0.0):
    return [pend(i, c, at) for i, c in enumerate(costs)]


def test_length_grouping_keeps_a_long_text_from_padding_short_ones():
    b = MicroBatcher(BatchLimits(max_batch_size=16, max_wait_s=0.004, max_batch_cost=4096, grouping="length"))
    queue = lengths(250, *([15] * 15))  # the long one is the oldest
    first = b.next_batch(queue, [], now=1.0)  # its wait is up: it goes, without the short ones
    assert [p.item for p in first.items] == [0]
    rest = [p for p in queue if p not in first.items]
    second = b.next_batch(rest, [], now=1.0)
    assert [p.cost for p in second.items] == [15] * 15


def test_length_grouping_runs_a_full_group_before_the_oldest_is_due():
    b = MicroBatcher(BatchLimits(max_batch_size=4, max_wait_s=0.010, grouping="length"))
    queue = lengths(200, 16, 16, 17, 15, 16)
    d = b.next_batch(queue, [], now=0.001)  # nothing due, but four short ones fill a batch
    assert sorted(p.item for p in d.items) == [1, 2, 3, 5]  # closest to the first short one
    lonely = b.next_batch([queue[0]], [], now=0.002)
    assert lonely == Wait(0.010)


@settings(max_examples=300)
@given(costs=st.lists(st.integers(1, 256), min_size=1, max_size=60), size=st.integers(1, 16),
       budget=st.integers(1, 4096), now=st.floats(0, 1), ratio=st.floats(1.0, 4.0))
def test_length_groups_stay_within_limits_and_take_the_oldest_when_due(costs, size, budget, now, ratio):
    b = MicroBatcher(BatchLimits(max_batch_size=size, max_wait_s=0.5, max_batch_cost=budget,
                                 grouping="length", length_ratio=ratio))
    queue = [pend(i, c, at=0.0) for i, c in enumerate(costs)]
    d = b.next_batch(queue, [], now)
    if isinstance(d, Wait):
        assert now < 0.5
        return
    cs = [p.cost for p in d.items]
    items = [p.item for p in d.items]
    assert 1 <= len(items) <= size and items == sorted(items)
    assert len(items) == 1 or padded_cost(cs) <= budget
    assert max(cs) <= ratio * min(cs) + 1e-9
    if now >= 0.5:
        assert items[0] == 0  # the oldest is never left behind once its wait is up


def test_a_zero_wait_sends_what_is_there_at_once():
    b = MicroBatcher(BatchLimits(max_batch_size=8, max_wait_s=0.05))
    assert isinstance(b.next_batch([pend(1, at=0.0)], [], now=0.001), Wait)
    assert [p.item for p in b.next_batch([pend(1, at=0.0)], [], now=0.001, max_wait_s=0.0).items] == [1]
