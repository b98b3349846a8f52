import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.policies.partitioning import Partitioner


def test_least_loaded_avoids_the_partition_that_is_behind():
    p = Partitioner(rng=random.Random(0))
    p.refresh({"t": {0: 500.0, 1: 0.0, 2: 10.0, 3: 20.0}})
    assert p.pick("t", 4, "r1", [5.0]) == [1]


def test_what_was_sent_since_the_refresh_counts_as_load():
    p = Partitioner(rng=random.Random(0))
    p.refresh({"t": {0: 0.0, 1: 0.0}})
    picks = [p.pick("t", 2, f"r{i}", [10.0])[0] for i in range(10)]
    assert picks.count(0) == picks.count(1) == 5


@given(n_parts=st.integers(1, 8), partitions=st.integers(1, 8), seed=st.integers(0, 100))
def test_parts_of_one_request_use_distinct_partitions_while_there_are_enough(n_parts, partitions, seed):
    p = Partitioner(rng=random.Random(seed))
    picks = p.pick("t", partitions, "r", [1.0] * n_parts)
    assert all(0 <= x < partitions for x in picks)
    assert len(set(picks)) == min(n_parts, partitions)


def test_other_strategies():
    assert Partitioner("hash").pick("t", 4, "r", [1, 1]) == [None, None]
    rr = Partitioner("round-robin")
    assert rr.pick("t", 3, "a", [1, 1]) + rr.pick("t", 3, "b", [1, 1]) == [0, 1, 2, 0]
    assert len(set(Partitioner("spread").pick("t", 4, "r", [1] * 4))) == 4
    with pytest.raises(ValueError):
        Partitioner("magic")
