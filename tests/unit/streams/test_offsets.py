"""The commit point never passes an unfinished record, whatever order work finishes in."""

from hypothesis import given, strategies as st

from streams.runtime.offsets import OffsetTracker


def test_out_of_order_finish_holds_the_commit_point_at_the_lowest_unfinished() -> None:
    t = OffsetTracker()
    t.assign(["p"])
    assert t.commit_point("p") is None
    for off in (100, 101, 102):
        t.take("p", off)
    assert t.finish("p", 101)
    assert t.commit_point("p") == 100  # 100 still runs: committing 102 would lose it on a crash
    t.finish("p", 100)
    assert t.commit_point("p") == 102
    t.finish("p", 102)
    assert t.commit_point("p") == 103
    t.take("q", 7)
    assert t.total_unfinished() == 1  # what the stage reports as mmstream_inflight


def test_a_finish_after_revoke_or_twice_changes_nothing() -> None:
    t = OffsetTracker()
    t.assign(["p"])
    t.take("p", 5)
    assert t.finish("p", 5) and not t.finish("p", 5)
    t.take("p", 6)
    t.revoke(["p"])
    assert not t.finish("p", 6) and t.commit_point("p") is None


def test_offsets_must_be_taken_in_order() -> None:
    t = OffsetTracker()
    t.take("p", 3)
    try:
        t.take("p", 2)
    except ValueError:
        return
    raise AssertionError("a lower offset after a higher one must be refused")


@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=60), st.randoms(use_true_random=False))
def test_commit_point_is_the_lowest_unfinished_offset(gaps: list[int], rnd) -> None:
    t = OffsetTracker()
    offsets, at = [], 0
    for g in gaps:  # offsets with gaps, as compacted or transactional topics have them
        at += g
        offsets.append(at)
        t.take("p", at)
    done: set[int] = set()
    for off in rnd.sample(offsets, len(offsets)):
        t.finish("p", off)
        done.add(off)
        unfinished = [o for o in offsets if o not in done]
        expected = min(unfinished) if unfinished else offsets[-1] + 1
        assert t.commit_point("p") == expected
        assert t.unfinished("p") == len(unfinished)
