"""The cache's circuit breaker: a short first cool-down, doubled by each failed trial up to
the cap, and closed again by one success."""

from hypothesis import given
from hypothesis import strategies as st

from workers.breaker import CircuitBreaker


def test_a_blip_costs_only_the_first_short_cooldown():
    b = CircuitBreaker(failures_to_open=3, cooldown_s=10, first_cooldown_s=0.25)
    for t in (0.0, 0.001, 0.002):
        assert b.allow(t)
        b.record(False, t)
    assert b.state == "open" and not b.allow(0.1)
    assert b.allow(0.3)  # the trial, a quarter second later
    b.record(True, 0.3)
    assert b.state == "closed" and b.allow(0.3)


def test_failed_trials_double_the_cooldown_up_to_the_cap():
    b = CircuitBreaker(failures_to_open=1, cooldown_s=2, first_cooldown_s=0.25)
    now = 0.0
    b.record(False, now)
    seen = []
    for _ in range(6):
        seen.append(b.current_cooldown_s)
        now += b.current_cooldown_s
        assert b.allow(now)
        b.record(False, now)
    assert seen == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    b.record(True, now)
    assert b.current_cooldown_s == 0 and b.state == "closed"
    b.record(False, now)  # a new outage starts short again
    assert b.current_cooldown_s == 0.25


@given(st.lists(st.booleans(), max_size=60), st.floats(0.01, 1.0), st.floats(1.0, 30.0))
def test_the_cooldown_never_passes_the_cap_and_success_always_closes(outcomes, first, cap):
    b = CircuitBreaker(failures_to_open=2, cooldown_s=cap, first_cooldown_s=first)
    now = 0.0
    for ok in outcomes:
        now += 0.1
        if not b.allow(now):
            continue
        b.record(ok, now)
        assert b.current_cooldown_s <= cap
        if ok:
            assert b.state == "closed"
