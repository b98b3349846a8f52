from streams.policies.budget import KeyedBudget


def test_each_key_has_its_own_burst_then_its_rate():
    b = KeyedBudget(rate_per_s=2, burst=3)
    assert [b.take("a", 0) for _ in range(4)] == [True, True, True, False]
    assert b.take("b", 0)  # another key is not charged for a's
    assert not b.take("a", 400) and b.take("a", 500)  # 2/s: one token after 500 ms
    assert KeyedBudget(0, 0).take("x", 0)  # rate 0: no limit


def test_keys_are_bounded_and_an_evicted_key_starts_full():
    b = KeyedBudget(rate_per_s=1, burst=1, max_keys=2)
    assert b.take("a", 0) and b.take("b", 0) and b.take("c", 0)
    assert len(b._tokens) == 2
