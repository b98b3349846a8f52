"""Fencing a stalled replica (a zombie) without Kafka transactions: a stage sends records only
while it knows it still owns its partitions.

The broker keeps a group member — and so its partitions — for ``session_timeout`` after the
last heartbeat it accepted. A replica that was stopped (SIGSTOP, a frozen VM, a stall) past
that has lost its partitions to another replica, which has replayed and answered their
requests; whatever the stalled one sends when it wakes up would answer them twice.

``Lease`` is the local, conservative view of that: it is *held* from the moment the
coordinator accepted a heartbeat or a join (timed from when the request was *sent*, which
is before the broker reset the member's timer) for ``session_timeout - margin``. While it
is not held, ``ProducerGate`` keeps every batch of the stage's producer in the producer's
accumulator (aiokafka's own "muted partitions": nothing is drained, so no sequence number
is spent). Then either

- a heartbeat is accepted again (the stall was shorter than the broker's patience): the
  lease is held again and the batches go out — the partitions were never anyone else's; or
- the coordinator answers that the member or its generation is gone: the rebalance revokes
  the partitions and ``ProducerGate.discard`` fails every held batch (``FencedError``); their
  input records stay unfinished and the next owner repeats them.

What is left unfenced: a batch drained (sequence assigned) just before the stall and written
to the socket after it — the time between the drain and the socket write, tens of
microseconds per batch (docs/reliability.md measures it). Kafka transactions would close
that too, at the latency cost measured there.

The hooks wrap two methods of aiokafka's group coordinator (``_do_heartbeat``,
``_do_rejoin_group``) and one of its producer accumulator (``drain_by_nodes``); aiokafka is
pinned (pyproject.toml) and ``tests/unit/streams/test_fence.py`` checks the hooks against it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from aiokafka.errors import KafkaError

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class FencedError(KafkaError):
    """An output held while this replica's ownership was in doubt, dropped when it was lost."""

    retriable = False


class Lease:
    """Whether this member may still act for its partitions, from its own clock. Pure."""

    def __init__(self, session_timeout_s: float, margin_s: float, clock: Clock = time.monotonic) -> None:
        if margin_s >= session_timeout_s:
            raise ValueError("the margin must be shorter than the session timeout")
        self.session_timeout_s = session_timeout_s
        self.margin_s = margin_s
        self.clock = clock
        self.renewed_at: float | None = None
        """Send time of the last heartbeat or join the coordinator accepted; None: not a member."""
        self.on_held: Callable[[], None] | None = None
        """Called when the lease goes from not held to held (to release held output)."""

    def held(self, now: float | None = None) -> bool:
        if self.renewed_at is None:
            return False
        return (self.clock() if now is None else now) < self.renewed_at + self.session_timeout_s - self.margin_s

    def expires_at(self) -> float | None:
        return None if self.renewed_at is None else self.renewed_at + self.session_timeout_s - self.margin_s

    def renew(self, sent_at: float) -> None:
        """The coordinator accepted a request sent at ``sent_at`` (monotonic seconds)."""
        was = self.held()
        if self.renewed_at is None or sent_at > self.renewed_at:
            self.renewed_at = sent_at
        if not was and self.held() and self.on_held is not None:
            self.on_held()

    def lose(self) -> None:
        """The coordinator said this member or its generation is gone."""
        self.renewed_at = None


def watch_coordinator(consumer: Any, lease: Lease) -> None:
    """Renew ``lease`` from the heartbeats and joins ``consumer``'s group coordinator gets
    accepted, and lose it when the coordinator resets the member. Call after ``start()``."""
    coordinator = consumer._coordinator  # noqa: SLF001 - see the module docstring
    if coordinator is None:
        raise RuntimeError("the consumer has no group coordinator (no group_id, or not started)")
    heartbeat, rejoin = coordinator._do_heartbeat, coordinator._do_rejoin_group  # noqa: SLF001

    async def do_heartbeat() -> bool:
        sent = lease.clock()
        ok = await heartbeat()
        if ok:
            lease.renew(sent)
        elif not coordinator.member_id:  # reset: unknown member or stale generation
            lease.lose()
        return ok

    async def do_rejoin_group(subscription: Any) -> bool:
        sent = lease.clock()
        ok = await rejoin(subscription)
        if ok:
            lease.renew(sent)
        return ok

    coordinator._do_heartbeat = do_heartbeat  # noqa: SLF001
    coordinator._do_rejoin_group = do_rejoin_group  # noqa: SLF001


class ProducerGate:
    """Holds a producer's batches in its accumulator while ``lease`` is not held."""

    def __init__(self, lease: Lease, name: str = "stage") -> None:
        self.lease = lease
        self.name = name
        self.producer: Any = None
        self.holding = False
        self.discarded = 0
        """Records dropped because ownership was lost while they were held."""
        lease.on_held = self.release

    def install(self, producer: Any) -> None:
        """Gate ``producer`` (started); a later call moves the gate to a new producer."""
        self.producer = producer
        acc = producer._message_accumulator  # noqa: SLF001 - see the module docstring
        drain = acc.drain_by_nodes

        def gated_drain(ignore_nodes: Any, muted_partitions: Any = frozenset()) -> Any:
            if not self.lease.held():
                if not self.holding:
                    self.holding = True
                    log.warning("%s: ownership in doubt (no heartbeat accepted for %.1fs): holding output",
                                self.name, self._since_renewal())
                muted_partitions = frozenset(muted_partitions) | frozenset(acc._batches)  # noqa: SLF001
            return drain(ignore_nodes, muted_partitions)

        acc.drain_by_nodes = gated_drain

    def release(self) -> None:
        """The lease is held again: let the sender drain what it held."""
        if self.holding:
            self.holding = False
            log.info("%s: ownership confirmed: sending held output", self.name)
        if self.producer is not None:
            waiter = self.producer._message_accumulator._waiter_future  # noqa: SLF001
            if not waiter.done():
                waiter.set_result(None)

    def discard(self) -> bool:
        """Fail every batch not yet drained (ownership is lost). Returns True when one of them
        had been drained before (a retry: its sequence number is spent), so the producer
        must be replaced before it sends again."""
        if self.producer is None:
            return False
        acc = self.producer._message_accumulator  # noqa: SLF001
        spent = False
        for tp in list(acc._batches):  # noqa: SLF001
            queue = acc._batches.pop(tp)  # noqa: SLF001
            for batch in queue:
                spent = spent or batch.retry_count > 0
                self.discarded += batch.record_count
                batch.failure(FencedError(f"ownership lost while held ({tp.topic}[{tp.partition}])"))
        self.holding = False
        return spent

    def _since_renewal(self) -> float:
        at = self.lease.renewed_at
        return float("inf") if at is None else self.lease.clock() - at
