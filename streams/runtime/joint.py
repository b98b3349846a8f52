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
    ``seal``ed, every answer it ``expect``s has come or been ``unexpect``ed, and every
    delivery reached the broker under the assignment it was read in. A delivery dropped by a
    revoke leaves it unfinished, for its next owner.

    Outputs given to ``hold`` leave with the answers, in one delivery once the last answer
    has come (at ``seal`` when none is due): one produce request, and one fetch for whoever
    reads them, instead of one each. A ``send`` meanwhile sends what is held first and ends
    the holding (later answers go one by one, as they come)."""

    def __init__(self, io: StageIO, record: ConsumerRecord, epoch: int | None = None) -> None:
        self.io = io
        self.record = record
        self.epoch = io.epoch if epoch is None else epoch
        """The assignment ``record`` was read in: every delivery is sent under it or dropped."""
        self.waiting = 0
        """Deliveries not landed yet."""
        self.due = 0
        """Answers expected and not come yet."""
        self.held: list[Out] | None = None
        self.sealed = False
        self.failed = False
        self.finished = False

    def send(self, outs: Sequence[Out]) -> None:
        """Deliver ``outs`` now, after whatever is held."""
        held, self.held = self.held or [], None
        self._deliver([*held, *outs])

    def hold(self, outs: Sequence[Out]) -> None:
        """Deliver ``outs`` with the answers expected, once they have all come."""
        self.held = [*(self.held or []), *outs]

    def expect(self) -> Callable[[Out], None]:
        """Where one output that comes later goes (call it exactly once)."""
        self.due += 1
        return self._answered

    def unexpect(self) -> None:
        """One output ``expect``ed will not come (its send is never called)."""
        self.due -= 1
        self._flush()
        self._check()

    def seal(self) -> None:
        """No more deliveries will be added."""
        self.sealed = True
        self._flush()
        self._check()

    def _answered(self, out: Out) -> None:
        self.due -= 1
        if self.held is None:
            self._deliver([out])
        else:
            self.held.append(out)
            self._flush()

    def _flush(self) -> None:
        if self.held is not None and self.sealed and self.due <= 0:
            held, self.held = self.held, None
            if held:
                self._deliver(held)

    def _deliver(self, outs: Sequence[Out]) -> asyncio.Task:
        self.waiting += 1
        task = self.io.deliver(outs, (), self.epoch)
        task.add_done_callback(self._landed)
        return task

    def _landed(self, task: asyncio.Task) -> None:
        self.waiting -= 1
        if task.cancelled() or task.exception() is not None or not task.result():
            self.failed = True
        self._check()

    def _check(self) -> None:
        if (self.sealed and self.due <= 0 and self.held is None and self.waiting <= 0 and not self.failed
                and not self.finished and self.io.epoch == self.epoch):
            self.finished = True
            self.io.finish([self.record])
