"""Which jobs a router's own encoder takes: while it has room and little work queued ahead
of the job's lane; the rest go through the encode topic to the whole pool."""

from hypothesis import given, strategies as st

from streams.policies.placement import Offer, take_local


def test_an_idle_encoder_takes_jobs_until_the_queued_work_passes_the_bound() -> None:
    offers = [Offer("rt", 10.0)] * 5
    assert take_local(offers, 0.0, 0.0, room=100, max_queued_ms=25.0) == [True, True, False, False, False]


def test_a_part_costlier_than_the_bound_never_runs_in_the_routers_process() -> None:
    assert take_local([Offer("rt", 80.0), Offer("rt", 5.0)], 0.0, 0.0, room=100, max_queued_ms=25.0) == [False, True]


def test_a_busy_encoder_takes_nothing_and_a_full_one_neither() -> None:
    assert take_local([Offer("rt", 1.0)], 30.0, 30.0, room=100, max_queued_ms=25.0) == [False]
    assert take_local([Offer("rt", 1.0)], 0.0, 0.0, room=0, max_queued_ms=25.0) == [False]
    assert take_local([Offer("rt", 1.0)] * 3, 0.0, 0.0, room=2, max_queued_ms=25.0) == [True, True, False]


def test_rt_waits_only_for_rt_and_bulk_for_everything() -> None:
    # 20 ms of bulk queued: an rt job goes ahead of it, a bulk job waits behind it.
    assert take_local([Offer("bulk", 5.0), Offer("rt", 10.0)], 0.0, 20.0, room=10, max_queued_ms=25.0) == [True, True]
    assert take_local([Offer("bulk", 5.0), Offer("bulk", 1.0)], 0.0, 20.0, room=10, max_queued_ms=25.0) == [True, False]
    # rt taken first counts against bulk too (it runs before them).
    assert take_local([Offer("rt", 20.0), Offer("bulk", 10.0)], 0.0, 0.0, room=10, max_queued_ms=25.0) == [True, False]


@given(st.lists(st.tuples(st.sampled_from(["rt", "bulk"]), st.floats(0, 50)), max_size=30),
       st.floats(0, 100), st.floats(0, 100), st.integers(0, 40), st.floats(0, 100))
def test_taken_jobs_never_exceed_the_room_or_start_past_the_bound(jobs, rt, bulk, room, bound) -> None:
    offers = [Offer(lane, ms) for lane, ms in jobs]
    taken = take_local(offers, rt, bulk + rt, room, bound)
    assert len(taken) == len(offers) and sum(taken) <= max(room, 0)
    ahead = {"rt": rt, "bulk": bulk + rt}
    for offer, took in zip(offers, taken):
        if took:
            assert ahead[offer.lane] + offer.cost_ms <= bound
            ahead["bulk"] += offer.cost_ms
            if offer.lane == "rt":
                ahead["rt"] += offer.cost_ms
