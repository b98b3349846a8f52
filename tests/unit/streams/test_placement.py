"""Which jobs a router's own encoder takes: while it has room, little work queued ahead of
the job's lane and the job itself is cheap; the rest go through the encode topic to the
whole pool."""

from hypothesis import given, strategies as st

from streams.policies.placement import Offer, take_local


def _take(offers, rt=0.0, bulk=0.0, room=100, queued=25.0, part=25.0):
    return take_local(offers, rt, bulk, room=room, max_queued_ms=queued, max_part_ms=part)


def test_an_idle_encoder_takes_jobs_until_the_queued_work_passes_the_bound() -> None:
    assert _take([Offer("rt", 10.0)] * 5) == [True, True, True, False, False]


def test_a_bound_of_zero_takes_a_job_only_while_nothing_is_queued() -> None:
    assert _take([Offer("rt", 3.0)] * 3, queued=0.0) == [True, False, False]
    assert _take([Offer("rt", 3.0)], rt=0.5, queued=0.0) == [False]


def test_a_part_costlier_than_its_bound_never_runs_in_the_routers_process() -> None:
    assert _take([Offer("rt", 80.0), Offer("rt", 5.0)]) == [False, True]
    assert _take([Offer("rt", 80.0)], queued=1000.0) == [False]  # however idle


def test_a_busy_encoder_takes_nothing_and_a_full_one_neither() -> None:
    assert _take([Offer("rt", 1.0)], rt=30.0, bulk=30.0) == [False]
    assert _take([Offer("rt", 1.0)], room=0) == [False]
    assert _take([Offer("rt", 1.0)] * 3, room=2) == [True, True, False]


def test_rt_waits_only_for_rt_and_bulk_for_everything() -> None:
    # 30 ms of bulk queued: an rt job goes ahead of it, a bulk job waits behind it.
    assert _take([Offer("bulk", 5.0), Offer("rt", 10.0)], bulk=20.0) == [True, True]
    assert _take([Offer("bulk", 10.0), Offer("bulk", 1.0)], bulk=20.0) == [True, False]
    # rt taken first counts against bulk too (it runs before them).
    assert _take([Offer("rt", 20.0), Offer("rt", 10.0), Offer("bulk", 1.0)]) == [True, True, False]


@given(st.lists(st.tuples(st.sampled_from(["rt", "bulk"]), st.floats(0, 50)), max_size=30),
       st.floats(0, 100), st.floats(0, 100), st.integers(0, 40), st.floats(0, 100), st.floats(0, 50))
def test_taken_jobs_never_exceed_the_room_or_start_past_the_bounds(jobs, rt, bulk, room, bound, part) -> None:
    offers = [Offer(lane, ms) for lane, ms in jobs]
    taken = _take(offers, rt, bulk + rt, room, bound, part)
    assert len(taken) == len(offers) and sum(taken) <= max(room, 0)
    ahead = {"rt": rt, "bulk": bulk + rt}
    for offer, took in zip(offers, taken):
        if took:
            assert ahead[offer.lane] <= bound and offer.cost_ms <= part
            ahead["bulk"] += offer.cost_ms
            if offer.lane == "rt":
                ahead["rt"] += offer.cost_ms
