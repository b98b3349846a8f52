"""How far a prediction runs from what happens, learned online. Pure.

A cost model knows its engine; it does not see what else takes time (neighbours on the same
cores, the broker hop and the intake before a job reaches the engine, prefix-cache hits,
sequences ending at eos). ``PredictionCalibration`` learns a high quantile of actual /
predicted over the predictions admission acted on, so that ``scale(predicted)`` is a value
about 90% of requests beat, and admission holds *that* to its bound (the mean would let half
of them past it).

Used for the generator's TTFT (``streams.policies.gen_admission``) and for the encoders' queue
wait (``streams.policies.load``: each encoder replica learns it from its own jobs and
reports it; the router scales its predicted wait by it).
"""

from __future__ import annotations

import math


class PredictionCalibration:
    """A running estimate of the ``quantile`` (0.9) of ``(actual + floor) / (predicted + floor)``
    (stochastic approximation on the log of the ratio, clamped to [``low``, ``high``]); starts
    at 1 (no correction).

    ``floor_ms`` keeps predictions near zero from swinging it: a 2 ms wait predicted as 0.5 is
    4x off and means nothing; with a floor of 50 it counts as 1.03x. ``scale`` applies the
    estimate the same way, so a constant lateness (a hop the model does not know) comes back as
    the same constant, whatever the prediction."""

    def __init__(self, quantile: float = 0.9, step: float = 0.05, low: float = 0.25, high: float = 4.0,
                 floor_ms: float = 0.0) -> None:
        self.quantile, self.step, self.floor_ms = quantile, step, floor_ms
        self._lo, self._hi = math.log(low), math.log(high)
        self._log = 0.0
        self.observed = 0

    def observe(self, predicted_ms: float, actual_ms: float) -> None:
        predicted, actual = predicted_ms + self.floor_ms, actual_ms + self.floor_ms
        if predicted <= 0 or actual <= 0:
            return
        x = math.log(actual / predicted)
        # Up by step * q when the ratio is above the estimate, down by step * (1 - q) below:
        # it settles where a share q of the ratios lies below it.
        self._log += self.step * (self.quantile - (1.0 if x < self._log else 0.0))
        self._log = min(self._hi, max(self._lo, self._log))
        self.observed += 1

    @property
    def factor(self) -> float:
        return math.exp(self._log)

    def scale(self, predicted_ms: float) -> float:
        return scaled(predicted_ms, self.factor, self.floor_ms)


def scaled(predicted_ms: float, factor: float, floor_ms: float = 0.0) -> float:
    """``predicted_ms`` corrected by a calibration ``factor`` learned with ``floor_ms`` (never below 0)."""
    return max(0.0, (predicted_ms + floor_ms) * factor - floor_ms)
