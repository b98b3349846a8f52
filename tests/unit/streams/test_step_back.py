"""When a raised router gives its CPU priority back (streams/policies/step_back.py)."""

import pytest

from streams.policies.step_back import StepBack


def test_it_stays_raised_below_the_rate_and_steps_back_at_it():
    p = StepBack(rate_per_s=5, hold_s=5)
    for t in (0.0, 0.3, 0.6, 0.9):  # four within a second: under five
        p.refused(t)
    assert p.update(1.0) is None and p.raised
    p.refused(1.5)  # five, but over 1.5 s: still under five a second
    assert p.update(1.5) is None and p.raised
    for t in (1.6, 1.7, 1.8, 1.9):  # five within [1.5, 1.9]
        p.refused(t)
    assert p.update(1.9) is False and not p.raised
    assert p.update(2.0) is None  # told once


def test_it_takes_the_raise_again_only_after_a_whole_hold_without_such_a_second():
    p = StepBack(rate_per_s=2, hold_s=5)
    p.refused(0.0)
    p.refused(0.5)
    assert p.update(0.5) is False
    assert p.update(5.4) is None  # 4.9 s since the second that set it off
    p.refused(5.45)
    p.refused(5.5)  # another such second: the hold starts again
    assert p.update(10.4) is None
    p.refused(9.0)  # one alone within a second is not the rate
    assert p.update(10.5) is True and p.raised


def test_refusals_spread_thinner_than_the_rate_never_set_it_off():
    p = StepBack(rate_per_s=5, hold_s=1)
    for i in range(1000):
        p.refused(i * 0.25)  # four a second, for 250 s
        assert p.update(i * 0.25) is None
    assert len(p._recent) == 5  # noqa: SLF001 — memory is the threshold's, not the traffic's


def test_rate_zero_never_steps_back_and_bad_values_are_refused():
    p = StepBack(rate_per_s=0, hold_s=5)
    for i in range(100):
        p.refused(i * 0.001)
    assert p.update(1.0) is None and p.raised
    with pytest.raises(ValueError):
        StepBack(rate_per_s=-1, hold_s=5)
    with pytest.raises(ValueError):
        StepBack(rate_per_s=5, hold_s=-1)
