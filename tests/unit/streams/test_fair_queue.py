"""The fair queue (streams.policies.fair_queue): rt first, bulk never starved, tenants in turn."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.policies.fair_queue import BULK_EVERY, FairQueue


def test_one_tenants_burst_waits_behind_its_own_jobs_not_in_front_of_the_others():
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("rt", "hog", f"hog{i}")
    q.push("rt", "quiet", "quiet0")
    assert [q.pop() for _ in range(3)] == ["hog0", "quiet0", "hog1"]
    assert len(q) == 3


def test_rt_first_and_bulk_never_starved():
    q: FairQueue[str] = FairQueue()
    q.push("bulk", "a", "b0")
    for i in range(20):
        q.push("rt", "a", f"r{i}")
    order = [q.pop() for _ in range(BULK_EVERY)]
    assert order[-1] == "b0" and all(x.startswith("r") for x in order[:-1])
    with pytest.raises(IndexError):
        FairQueue().pop()


@given(st.lists(st.tuples(st.sampled_from(["rt", "bulk"]), st.sampled_from("abc"), st.integers()), max_size=60))
def test_every_item_comes_out_once_in_its_tenants_order(pushes):
    q: FairQueue[tuple] = FairQueue()
    for i, (lane, tenant, _) in enumerate(pushes):
        q.push(lane, tenant, (lane, tenant, i))
    out = [q.pop() for _ in range(len(q))]
    assert sorted(x[2] for x in out) == list(range(len(pushes))) and len(q) == 0
    for lane in ("rt", "bulk"):
        for tenant in "abc":
            mine = [x[2] for x in out if x[:2] == (lane, tenant)]
            assert mine == sorted(mine)
