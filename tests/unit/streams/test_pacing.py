import pytest

from streams.policies.pacing import LargeRecordPacing, Pacing

MB = 1024 * 1024


def test_a_tenant_past_its_large_record_bytes_is_held_while_another_tenant_is_served():
    p = LargeRecordPacing(rate_bytes_per_s=2 * MB, large_bytes=256 * 1024)
    assert p.polled({"a": [MB], "b": [300]}, now=0.0) == {}  # a second's worth saved up: 1 of 2 MiB taken
    holds = p.polled({"a": [2 * MB]}, now=0.1)  # b's record came 0.1 s ago: a waits for what it owes
    # 1 MiB left at 0.0, 0.2 MiB refilled since, 2 MiB taken: 0.8 MiB owed at 2 MiB/s
    assert holds == {"a": pytest.approx(0.5)}
    assert p.available("a", holds["a"]) == pytest.approx(0.0)  # paid back exactly when the hold ends


def test_small_records_never_count_and_a_tenant_alone_is_never_held():
    p = LargeRecordPacing(rate_bytes_per_s=MB, large_bytes=256 * 1024)
    assert p.polled({"b": [200 * 1024] * 50, "a": [100]}, now=0.0) == {}  # 10 MB of small records
    assert p.available("b", 0.0) == MB
    alone = LargeRecordPacing(rate_bytes_per_s=MB, large_bytes=256 * 1024)
    for i in range(10):  # 4 MiB a second, nobody else: read as fast as it comes
        assert alone.polled({"a": [MB]}, now=i * 0.25) == {}
    assert alone.available("a", 2.5) < 0  # it owes, and is held the moment another tenant shows up
    assert "a" in alone.polled({"a": [MB], "b": [10]}, now=2.5)


def test_a_tenant_that_stops_is_forgotten_once_paid_back():
    p = LargeRecordPacing(rate_bytes_per_s=MB, large_bytes=10, window_s=1.0)
    p.polled({"a": [3 * MB], "b": [1]}, now=0.0)
    p.polled({"c": [1]}, now=10.0)  # long after: a has paid back, b and a are out of the window
    assert set(p._tokens) == set() and set(p._seen) == {"c"}  # noqa: SLF001


def test_pacing_needs_a_rate_and_a_window():
    for rate, large, window in ((0, 1, 1.0), (1, -1, 1.0), (1, 1, 0.0)):
        with pytest.raises(ValueError):
            LargeRecordPacing(rate, large, window)


def test_any_unit_can_be_paced_and_nothing_taken_holds_no_one():
    p = Pacing(rate_per_s=10.0)
    p.seen({"a", "b"}, now=0.0)
    assert p.take({"a": 10.0, "b": 0.0}, now=0.0) == {}  # a second's worth
    assert p.take({"a": 5.0}, now=0.0) == {"a": pytest.approx(0.5)}
    assert p.available("b", 0.0) == 10.0
    with pytest.raises(ValueError):
        Pacing(0.0)


def test_one_hold_is_at_most_max_hold_s_and_the_rest_is_forgiven():
    p = Pacing(rate_per_s=10.0)
    p.seen({"a", "b"}, now=0.0)
    assert p.take({"a": 1000.0}, now=0.0) == {"a": pytest.approx(60.0)}  # two backlog polls, refused at once
    assert p.available("a", 60.0) == pytest.approx(0.0)


def test_others_are_seen_only_within_the_window():
    p = Pacing(rate_per_s=10.0, window_s=1.0)
    p.seen({"a", "b", "c"}, now=0.0)
    assert p.others_seen("a", 0.5)
    assert not p.others_seen("a", 2.5)  # swept: nobody came since
