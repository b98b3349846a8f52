"""What a batch costs an engine, learned from the batches it ran. Pure.

A transformer's batch of ``n`` rows padded to ``L`` tokens costs about
``c0 + c1·n·L + c2·n·L²`` milliseconds: a fixed call overhead, work per padded token, and
attention, which grows with the square of the length. An engine that runs a batch's rows one
by one (``rows_alone``) pays the fixed overhead per row: ``c0·n + …``, so company saves it
nothing. An image model sees one fixed-size
input per row (``L`` = 1), so only ``c0 + c1·n`` matters. ``BatchCostModel`` starts from a
prior (or a calibration run at start-up), then refits those three coefficients by least
squares over the last ``window`` batches it was told about (batches all of one shape only
scale them: ``_fit_level``).

It answers the questions the stage and the router ask:

- ``predict(n, L)``: ms of one batch of n rows of length L;
- ``batch_ms(lengths)``: ms of one batch of items of these lengths, run the way the engine
  runs it (padded to the longest, or each row alone at its own length): the batcher's budget;
- ``per_item_ms(L)``: ms one item of length ``L`` costs when it rides in the batch it
  would get (as many peers as the budget allows): what queued work is worth;
- ``batching_gain(L)``: how much a full batch saves per item over items alone (an engine
  whose batches save nothing should not keep an item waiting for company);
- ``rows_within(L, max_ms)``: how many rows of length ``L`` fit in ``max_ms``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class Observation:
    rows: int
    length: float
    ms: float
    tokens: float | None = None
    """Sum of the rows' own lengths when they ran unpadded (rows alone); None: ``rows·length``."""
    squares: float | None = None
    """Sum of the squares of those lengths; None: ``rows·length²``."""


class BatchCostModel:
    def __init__(self, prior: tuple[float, float, float], window: int = 256, min_fit: int = 12,
                 max_batch_size: int = 16, max_batch_ms: float = 50.0, rows_alone: bool = False) -> None:
        if window < 4 or max_batch_size < 1 or max_batch_ms <= 0:
            raise ValueError("invalid cost model limits")
        self.coef = tuple(float(c) for c in prior)
        self.window: deque[Observation] = deque(maxlen=window)
        self.min_fit = min_fit
        self.max_batch_size = max_batch_size
        self.max_batch_ms = max_batch_ms
        self.rows_alone = rows_alone

    def predict(self, rows: int, length: float) -> float:
        c0, c1, c2 = self.coef
        tokens = rows * length
        return max(0.0, c0 * (rows if self.rows_alone else 1) + c1 * tokens + c2 * tokens * length)

    def batch_ms(self, lengths: Sequence[float]) -> float:
        """Predicted ms of one batch of items of these lengths: padded to the longest, or,
        for an engine that runs rows alone, each row at its own length."""
        if not lengths:
            return 0.0
        if self.rows_alone:
            return sum(self.predict(1, length) for length in lengths)
        return self.predict(len(lengths), max(lengths))

    def observe(self, rows: int, length: float, ms: float) -> None:
        """One batch that ran: ``rows`` rows padded to ``length`` took ``ms``."""
        if rows < 1 or length <= 0 or ms < 0:
            return
        self._add(Observation(rows, float(length), float(ms)))

    def observe_batch(self, lengths: Sequence[float], ms: float) -> None:
        """One batch of items of these lengths took ``ms`` (run as ``batch_ms`` says)."""
        if not lengths or min(lengths) <= 0 or ms < 0:
            return
        if not self.rows_alone:
            self.observe(len(lengths), max(lengths), ms)
            return
        self._add(Observation(len(lengths), float(max(lengths)), float(ms), float(sum(lengths)),
                              float(sum(x * x for x in lengths))))

    def _add(self, observation: Observation) -> None:
        self.window.append(observation)
        if len(self.window) >= self.min_fit:
            self._fit()

    def calibrate(self, observations: list[Observation]) -> None:
        """Start from timed batches (the worker's start-up run) instead of the prior."""
        for o in observations:
            self.window.append(o)
        if observations:
            self._fit(force=True)

    def rows_within(self, length: float, max_ms: float | None = None) -> int:
        """Most rows of ``length`` one batch may hold under ``max_ms`` (at least 1)."""
        limit = self.max_batch_ms if max_ms is None else max_ms
        rows = 1
        while rows < self.max_batch_size and self.predict(rows + 1, length) <= limit:
            rows += 1
        return rows

    def batching_gain(self, length: float) -> float:
        """How much cheaper per item a full batch of ``length`` is than items alone (0: none,
        so waiting for company only adds latency)."""
        rows = self.rows_within(length)
        alone = self.predict(1, length)
        return 0.0 if rows < 2 or alone <= 0 else max(0.0, 1.0 - self.predict(rows, length) / (rows * alone))

    def per_item_ms(self, length: float) -> float:
        rows = self.rows_within(length)
        return self.predict(rows, length) / rows

    def _features(self, o: Observation) -> list[float]:
        tokens = o.tokens if o.tokens is not None else o.rows * o.length
        squares = o.squares if o.squares is not None else o.rows * o.length * o.length
        return [float(o.rows) if self.rows_alone else 1.0, tokens, squares]

    def _fit(self, force: bool = False) -> None:
        obs = list(self.window)
        x = np.array([self._features(o) for o in obs])
        y = np.array([o.ms for o in obs])
        # Nothing to separate: every batch the same size (padded), or, rows alone, every row
        # the same length (the columns are then multiples of one another).
        spread = x[:, 1] / x[:, 0] if self.rows_alone else x[:, 1]
        if not force and np.ptp(spread) == 0:
            self._fit_level(x, y)
            return
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        c0, c1, c2 = (float(c) for c in coef)
        # Costs never shrink with more work: clip what noise made negative, and refit the rest.
        if c2 < 0 or c1 < 0 or c0 < 0:
            c0, c1, c2 = max(c0, 0.0), max(c1, 0.0), max(c2, 0.0)
            if c1 == 0.0 and c2 == 0.0:
                c1 = float(np.sum(y) / max(np.sum(x[:, 1]), 1e-9))
        self.coef = (c0, c1, c2)

    def _fit_level(self, x: np.ndarray, y: np.ndarray) -> None:
        """Batches all of one shape (a stage that only ever runs one clip at a time) cannot
        separate the coefficients, but they do say what that shape costs: the current ones
        are scaled to it. Without this a prior from another machine stood for good (whisper's
        300 ms a clip against 1.8 s measured on 2 cores: audio admitted and charged a sixth of
        what it cost)."""
        predicted = float(np.sum(x @ np.array(self.coef)))
        if predicted > 0:
            factor = float(np.sum(y)) / predicted
            self.coef = tuple(c * factor for c in self.coef)

