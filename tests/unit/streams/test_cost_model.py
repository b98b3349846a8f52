"""The batch cost model learns c0 + c1·n·L + c2·n·L² from what batches took."""

import random

from streams.policies.cost_model import BatchCostModel, Observation


def test_it_recovers_the_coefficients_of_noisy_batches() -> None:
    true = (1.0, 0.05, 0.0004)
    m = BatchCostModel(prior=(10.0, 1.0, 0.0))
    rng = random.Random(3)
    for _ in range(200):
        n, L = rng.randint(1, 16), rng.choice([16, 32, 64, 128, 256])
        ms = true[0] + true[1] * n * L + true[2] * n * L * L
        m.observe(n, L, ms * rng.uniform(0.95, 1.05))
    assert abs(m.predict(8, 64) - (1.0 + 0.05 * 512 + 0.0004 * 512 * 64)) < 2.0
    assert abs(m.predict(1, 256) - (1.0 + 0.05 * 256 + 0.0004 * 256 * 256)) < 3.0


def test_short_items_ride_in_bigger_batches_and_cost_less_each() -> None:
    m = BatchCostModel(prior=(2.0, 0.05, 0.0002), max_batch_size=16, max_batch_ms=50.0)
    assert m.rows_within(16) == 16 and m.rows_within(256) < 4
    assert m.per_item_ms(16) < m.predict(1, 16)
    assert m.predict(m.rows_within(128), 128) <= 50.0


def test_calibration_replaces_the_prior_and_costs_never_go_negative() -> None:
    m = BatchCostModel(prior=(100.0, 100.0, 100.0))
    m.calibrate([Observation(1, 16, 2.0), Observation(8, 16, 6.0), Observation(1, 128, 8.0), Observation(4, 128, 30.0)])
    assert m.predict(1, 16) < 5.0
    assert all(c >= 0 for c in m.coef)


def test_images_fit_per_row() -> None:
    m = BatchCostModel(prior=(0.0, 10.0, 0.0))
    for n in (1, 2, 4, 8, 1, 3, 6, 8, 2, 5, 7, 4):
        m.observe(n, 1, 1.5 + 4.0 * n)
    assert abs(m.predict(8, 1) - 33.5) < 0.5


def test_batching_gain_says_when_waiting_for_company_pays() -> None:
    batched = BatchCostModel(prior=(4.0, 0.05, 0.0))  # a fixed cost per call: company amortizes it
    alone = BatchCostModel(prior=(0.0, 0.1, 0.0))  # rows run one by one: company saves nothing
    assert batched.batching_gain(16) > 0.5 and alone.batching_gain(16) == 0.0


def test_rows_alone_pays_the_fixed_cost_per_row_and_never_gains_from_company() -> None:
    m = BatchCostModel(prior=(5.0, 1.0, 0.0), rows_alone=True, min_fit=4)
    for n, length in ((1, 16), (4, 16), (2, 64), (8, 32), (1, 128), (3, 48)):
        m.observe(n, length, n * (1.5 + 0.1 * length))  # each row alone: 1.5 ms + 0.1 ms per token
    assert abs(m.predict(8, 32) - 8 * (1.5 + 3.2)) < 0.01
    assert m.batching_gain(32) < 1e-9
    shared = BatchCostModel(prior=(5.0, 0.1, 0.0))  # a fixed cost paid once per batch
    assert shared.batching_gain(32) > 0.5


def test_rows_alone_batches_cost_each_row_at_its_own_length():
    true = lambda length: 1.0 + 0.05 * length + 0.0002 * length * length  # noqa: E731 (one row alone, ms)
    m = BatchCostModel(prior=(5.0, 1.0, 0.0), rows_alone=True, min_fit=4)
    mixes = ([15, 60, 250], [15, 15, 60], [250], [60, 60, 15, 15], [15], [250, 15], [60], [15, 60])
    for lengths in mixes * 3:
        m.observe_batch(lengths, sum(true(x) for x in lengths))
    for lengths in ([15, 250], [250, 250, 60], [15]):
        assert abs(m.batch_ms(lengths) - sum(true(x) for x in lengths)) < 0.01
    assert abs(m.per_item_ms(250) - true(250)) < 0.01  # what admission counts a long text at


def test_a_window_of_one_length_keeps_the_shape_and_learns_the_level():
    m = BatchCostModel(prior=(1.0, 0.05, 0.0002), rows_alone=True, min_fit=4)
    before = (m.predict(1, 16), m.predict(1, 256))
    for n in (1, 2, 3, 4, 5, 6, 7, 8) * 4:
        m.observe_batch([32] * n, n * 4.0)  # rows of one length only: nothing tells 16 from 256
    assert abs(m.predict(1, 32) - 4.0) < 1e-9  # what it saw
    factor = 4.0 / (1.0 + 0.05 * 32 + 0.0002 * 32 * 32)  # the rest scaled alike: no shape made up
    assert abs(m.predict(1, 16) - before[0] * factor) < 1e-9 and abs(m.predict(1, 256) - before[1] * factor) < 1e-9


def test_a_stage_that_only_runs_one_item_of_one_size_learns_what_it_costs():
    """The audio stage: every clip is one unit, most batches one clip. A prior from another
    machine (300 ms) gives way to what the clips took (1.8 s)."""
    m = BatchCostModel(prior=(0.0, 300.0, 0.0), max_batch_size=8, max_batch_ms=50.0)
    for ms in (1750.0, 1850.0) * 6:
        m.observe_batch([1.0], ms)
    assert abs(m.per_item_ms(1.0) - 1800.0) < 1e-6 and abs(m.batch_ms([1.0, 1.0]) - 3600.0) < 1e-6
