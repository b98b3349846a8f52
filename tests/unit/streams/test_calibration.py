"""PredictionCalibration: a high quantile of how far predictions run, learned online."""

from __future__ import annotations

import random

from streams.policies.calibration import PredictionCalibration, scaled


def test_the_calibration_learns_a_high_quantile_of_how_far_predictions_run() -> None:
    cal = PredictionCalibration()
    assert cal.scale(800) == 800
    rng = random.Random(3)
    ratios = [rng.uniform(0.2, 0.6) for _ in range(3000)]  # predictions 1.7-5x too high
    for r in ratios:
        cal.observe(1000, 1000 * r)
    below = sum(r < cal.factor for r in ratios[-1000:]) / 1000
    assert 0.8 < below < 0.97, (cal.factor, below)
    for _ in range(500):
        cal.observe(100, 10_000)  # a hundred times too low: clamped
    assert cal.factor <= 4.0 + 1e-9
    cal.observe(0, 10)  # nothing to learn from


def test_with_a_floor_a_constant_lateness_comes_back_as_that_constant() -> None:
    # Every wait runs 150 ms past its prediction (a hop the model does not know), whatever
    # the prediction: scaled predictions of the sizes it learned from come out about that late.
    cal = PredictionCalibration(quantile=0.5, floor_ms=50.0)
    rng = random.Random(5)
    for _ in range(4000):
        p = rng.uniform(100, 200)
        cal.observe(p, p + 150)
    for p in (100.0, 150.0, 200.0):
        assert p + 100 < cal.scale(p) < p + 200, (p, cal.scale(p), cal.factor)


def test_with_a_floor_waits_near_zero_teach_little() -> None:
    # An idle queue: predicted 0-2 ms, waited 2-6 ms (the hop). Without a floor that is "3x
    # late" and would triple every later prediction; with one it is a few per cent.
    bare, floored = PredictionCalibration(), PredictionCalibration(floor_ms=50.0)
    rng = random.Random(7)
    for _ in range(2000):
        p, a = rng.uniform(0.5, 2.0), rng.uniform(2.0, 6.0)
        bare.observe(p, a)
        floored.observe(p, a)
    assert bare.factor > 2.5
    assert floored.factor < 1.15
    assert floored.scale(300) < 300 * 1.15


def test_scaled_never_goes_below_zero_and_is_the_identity_at_factor_one() -> None:
    assert scaled(10.0, 0.5, 50.0) == 0.0
    assert scaled(123.0, 1.0, 50.0) == 123.0
    assert scaled(100.0, 2.0, 50.0) == 250.0
