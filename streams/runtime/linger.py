"""Outputs held a little while in the hope that a later output takes them along: one produce
request (and one fetch for whoever reads them) instead of two. The assembler holds a
request's ``accepted`` event this way until its answer comes or ``delay_ms`` passes
(``assembler.accepted_linger_ms``): Kafka's ``linger.ms``, for one kind of record."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Callable

from schemas.trace import now_ms
from streams.runtime.produce import Out


@dataclass(eq=False)
class Held:
    """One held output: ``out`` is None once it was taken or sent."""

    out: Out | None
    due_ms: float


def take(held: Held | None) -> Out | None:
    """The output still held in ``held`` (None when there is none), no longer held."""
    if held is None or held.out is None:
        return None
    out, held.out = held.out, None
    return out


class Linger:
    """Holds outputs up to ``delay_ms`` each; ``send`` gets those whose time came, together,
    from a timer on the running loop (one timer at a time, for the oldest)."""

    def __init__(self, delay_ms: float, send: Callable[[list[Out]], object],
                 clock: Callable[[], float] = now_ms) -> None:
        self.delay_ms = delay_ms
        self._send = send
        self._clock = clock
        self._held: deque[Held] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def hold(self, out: Out, now: float | None = None) -> Held | None:
        """Hold ``out`` (take it back with ``take``); with ``delay_ms`` 0 it is sent at once
        and None comes back."""
        if self.delay_ms <= 0:
            self._send([out])
            return None
        held = Held(out, (self._clock() if now is None else now) + self.delay_ms)
        self._held.append(held)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay_ms / 1000.0, self._flush)
        return held

    def __len__(self) -> int:
        return sum(1 for h in self._held if h.out is not None)

    def _flush(self) -> None:
        self._timer = None
        now, due = self._clock(), []
        held = self._held
        while held and (held[0].due_ms <= now or held[0].out is None):
            out = take(held.popleft())
            if out is not None:
                due.append(out)
        if due:
            self._send(due)
        if held:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, (held[0].due_ms - now) / 1000.0),
                                                               self._flush)
