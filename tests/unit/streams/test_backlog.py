"""The router's backlog bound (``streams.policies.backlog``): a record is late only once the
backlog has stood a whole interval with no record at or under the target, while admission
refuses for want of capacity."""

import pytest

from streams.policies.backlog import StandingBacklog


def test_a_burst_worked_off_within_the_interval_is_routed_whole():
    b = StandingBacklog(400.0)  # target 100 ms, interval 1 s
    assert not b.late(5.0, 10.0)  # the burst's first record: read at once
    # its last ones waited long, but a good record was read less than a second ago
    assert not any(b.late(waited, 10.0 + i * 0.09) for i, waited in enumerate(range(150, 1050, 100)))


def test_a_standing_backlog_refuses_what_waited_past_the_bound_only():
    b = StandingBacklog(400.0)
    b.capacity_refused(10.0)
    assert not b.late(50.0, 10.0)
    assert not b.late(300.0, 10.5)  # over the target: the backlog has stood half a second
    assert not b.late(450.0, 10.9)  # past the bound, but within the interval
    b.capacity_refused(10.8)
    assert b.late(450.0, 11.1)  # a whole second with no good record
    assert not b.late(350.0, 11.2)  # under the bound: routed, even in a standing backlog
    assert b.standing(11.2)


def test_one_good_record_ends_the_standing_backlog():
    b = StandingBacklog(400.0)
    b.late(10.0, 0.0)
    b.capacity_refused(1.9)
    assert b.late(900.0, 2.0)
    assert not b.late(80.0, 2.1)  # at or under the target: the router caught up
    assert not b.late(900.0, 2.5) and not b.standing(2.5)
    b.capacity_refused(3.0)
    assert b.late(900.0, 3.2)


def test_no_refusal_where_admission_refuses_nothing_for_capacity():
    """Records that wait on a slow network, or behind a flood its tenant's quota sheds, are
    not refused: later would not change that."""
    b = StandingBacklog(400.0)
    b.late(10.0, 0.0)
    assert not b.late(900.0, 2.0) and not b.standing(2.0)  # a backlog, but the engines have room
    b.capacity_refused(2.1)
    assert b.late(900.0, 2.2)
    assert not b.late(900.0, 3.2)  # no capacity refusal in the last second


def test_the_first_record_and_a_take_over_get_an_interval_of_their_own():
    b = StandingBacklog(400.0)
    b.capacity_refused(100.0)
    assert not b.late(5_000.0, 100.0)  # nothing read before: no interval has passed
    b.capacity_refused(100.5)
    assert not b.late(5_000.0, 100.9) and b.late(5_000.0, 101.1)
    b.reset(101.2)  # partitions taken over: their backlog is new to this router
    b.capacity_refused(101.5)
    assert not b.late(5_000.0, 101.5) and b.late(5_000.0, 102.3)


def test_off_refuses_nothing_and_bad_bounds_are_refused():
    b = StandingBacklog(0.0)
    b.late(1.0, 0.0)
    b.capacity_refused(99.0)
    assert not b.late(60_000.0, 100.0) and not b.standing(100.0)
    with pytest.raises(ValueError):
        StandingBacklog(-1.0)
    assert StandingBacklog(400.0, target_ms=20.0).target_ms == 20.0
