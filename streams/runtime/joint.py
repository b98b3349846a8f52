"""One input record whose outputs leave in several deliveries, some of them later: the router's
ingress record whose encode jobs a co-located encoder answers in this process
(``router.colocate``). ``StageIO.deliver`` finishes its inputs when one delivery lands; a
``Joint`` finishes its record when all of them have."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Sequence

from aiokafka.structs import ConsumerRecord

from streams.runtime.produce import Out

if TYPE_CHECKING:  # annotations only: a Joint is given the StageIO it delivers through
    from streams.runtime.io import StageIO


class Joint:
    """One input record whose outputs leave in several deliveries, some of them later (the
    answers of a stage co-located in this process): the record is finished once it is
    ``seal``ed and every delivery it expects reached the broker under the assignment it was
    read in. A delivery dropped by a revoke leaves it unfinished, for its next owner."""

    def __init__(self, io: StageIO, record: ConsumerRecord, epoch: int | None = None) -> None:
        self.io = io
        self.record = record
        self.epoch = io.epoch if epoch is None else epoch
        """The assignment ``record`` was read in: every delivery is sent under it or dropped."""
        self.waiting = 0
        self.sealed = False
        self.failed = False
        self.finished = False

    def send(self, outs: Sequence[Out]) -> None:
        """Deliver ``outs`` now."""
        self.waiting += 1
        self._deliver(outs)

    def expect(self) -> Callable[[Out], None]:
        """Where one output that comes later goes (call it exactly once)."""
        self.waiting += 1
        return lambda out: self._deliver([out])

    def unexpect(self) -> None:
        """One output ``expect``ed will not come (its send is never called)."""
        self.waiting -= 1

    def seal(self) -> None:
        """No more deliveries will be added."""
        self.sealed = True
        self._check()

    def _deliver(self, outs: Sequence[Out]) -> None:
        self.io.deliver(outs, (), self.epoch).add_done_callback(self._landed)

    def _landed(self, task: asyncio.Task) -> None:
        self.waiting -= 1
        if task.cancelled() or task.exception() is not None or not task.result():
            self.failed = True
        self._check()

    def _check(self) -> None:
        if (self.sealed and self.waiting <= 0 and not self.failed and not self.finished
                and self.io.epoch == self.epoch):
            self.finished = True
            self.io.finish([self.record])
