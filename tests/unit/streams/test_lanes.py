from hypothesis import given
from hypothesis import strategies as st

from streams.lanes import LaneGate


def test_bulk_waits_while_rt_is_behind_and_resumes_when_it_caught_up():
    gate = LaneGate(pause_records=10, resume_records=2)
    assert [gate.update(b) for b in (0, 11, 5, 3, 2, 0, 12)] == [None, "pause", None, None, "resume", None, "pause"]


@given(st.lists(st.integers(0, 50), max_size=40))
def test_pause_and_resume_alternate(backlogs):
    gate = LaneGate(pause_records=10, resume_records=2)
    changes = [c for c in (gate.update(b) for b in backlogs) if c]
    assert all(a != b for a, b in zip(changes, changes[1:]))
    assert not changes or changes[0] == "pause"
