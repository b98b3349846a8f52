"""The router's direct answers (``router.answer_local``): an embed request with one part that
the router's own encoder takes is answered by the router, with a done marker of its own,
instead of going to the assembler as a manifest and an encoded part. Which requests qualify,
and how the router and the assembler keep out of each other's way, is
``streams.policies.direct``'s; this module carries it out:

- ``DirectJoint``: the request's ingress record, finished once its answer (the ``accepted``
  event, the terminal event, the done marker) is with the broker. The answer is built by the
  assembler's own state machine (``streams.policies.assembly.step``) from the manifest and
  the part, so it reads exactly as the assembler's would. A job the encoder does not take
  goes the assembler's way after all, with its manifest.
- ``DirectAnswers``: the ledgers of the router's ingress partitions, and their take-over
  (``streams.runtime.recovery.recover`` on the router's done topic: answered keys, the
  partition's replay range, and terminal events already on reply topics).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import CONTENT_TYPE_HEADER, header, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import EncodedPart, Manifest, Verdict, fan_in_from_wire, request_key
from schemas.request import TENANT_RE, peek_reply
from schemas.topics import TopicNames
from schemas.trace import now_ms
from streams.observe.metrics import Metrics, observe_terminal
from streams.policies.assembly import TERMINAL_SEQ, AssemblyPolicy, accepted_event, reused_id, step
from streams.policies.direct import Action, Ledger, Seen
from streams.policies.lifecycle import RequestStatus
from streams.runtime.joint import Joint
from streams.runtime.produce import Out, out_map
from streams.runtime.recovery import Recovered, done_marker

log = logging.getLogger(__name__)

MAX_KEYS_PER_PARTITION = 200_000
"""Most keys one ingress partition index's ledger holds, over every ingress topic (the
assembler's retention bounds it first at any rate under about 1,600 requests a second per
partition index)."""


class DirectJoint(Joint):
    """An ingress record whose one job the router's encoder answers, answered here: the
    manifest held by the joint is replaced by the request's answer (``answer`` turns the
    encoded part's record into the records to send). Not taken (``unexpect``): the held
    manifest goes the assembler's way with the job, as for any joint."""

    def __init__(self, io: Any, record: ConsumerRecord, epoch: int, answer: Callable[[Out], list[Out]],
                 declined: Callable[[], None], landed: Callable[[], None] = lambda: None) -> None:
        super().__init__(io, record, epoch)
        self.answer = answer
        self.declined = declined
        self.landed = landed
        """Called once the answer is with the broker (the whole-result store: nothing the answer
        waits behind on the loop)."""

    def unexpect(self) -> None:
        self.declined()
        super().unexpect()

    def _answered(self, out: Out) -> None:
        try:
            outs = self.answer(out)
        except Exception:  # ``answer`` answers its own failures; this is a bug past that
            log.exception("router: a direct answer could not be built; the assembler answers it")
            super()._answered(out)  # the held manifest and the part go the assembler's way, as for any joint
            return
        self.due -= 1
        self.held = None  # the manifest: the assembler never hears of this request
        self._deliver(outs).add_done_callback(self._answer_landed)

    def _answer_landed(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None or not task.result():
            return
        try:
            self.landed()
        except Exception:  # what follows an answer never costs it
            log.exception("router: after the direct answer of %s", self.record.key)


class DirectAnswers:
    """The router's side of direct answers: one ``Ledger`` per ingress partition it owns."""

    def __init__(self, names: TopicNames, metrics: Metrics, results: Any, retention_ms: float,
                 default_reply: Callable[[str | None], str], tenant_of: Callable[[str], str | None]) -> None:
        self.names = names
        self.metrics = metrics
        self.results = results
        self.policy = AssemblyPolicy(retention_ms=retention_ms)
        self.retention_ms = retention_ms
        self.default_reply = default_reply
        self.tenant_of = tenant_of
        self.done_partitions = 1
        """Partitions of the router's done topic (read at each take-over): a marker goes to the
        ingress partition's index modulo this."""
        self.ledgers: dict[int, Ledger] = {}
        """Ingress partition index -> its ledger (shared by the shared and every tenant's topics)."""
        self.owned: set[TopicPartition] = set()
        self.failures = 0

    # -- ownership -----------------------------------------------------------------------

    def assigned(self, tps: set[TopicPartition], found: Recovered | None) -> None:
        """Partitions taken over, with what ``recover`` found (None: it failed, and these
        partitions answer nothing directly in this assignment: their replay range is unknown).
        A partition whose last owner handled records younger than the retention
        (``Recovered.unseen``) answers nothing directly for one retention (``Ledger.direct_from``)."""
        now = now_ms()
        for tp in tps:
            self.owned.add(tp)
            ledger = self.ledgers.get(tp.partition)
            if ledger is None:
                ledger = self.ledgers[tp.partition] = Ledger(self.retention_ms, MAX_KEYS_PER_PARTITION)
            if found is None:
                ledger.replay_end[tp.topic] = 2 ** 62
                continue
            ledger.replay_end[tp.topic] = found.ends.get(tp, 0)
            if tp in found.unseen:
                ledger.direct_from[tp.topic] = now + self.retention_ms
            for key, at in found.done.get(tp, {}).items():  # every topic of this index has the same markers
                if key not in ledger.seen:
                    ledger.seen[key] = Seen(at, found.digests.get(key), True)
            ledger.answered_before |= {k for k, marks in found.sent.items() if any(m[0] == "terminal" for m in marks)}
        for ledger in self.ledgers.values():
            ledger.seen = dict(sorted(ledger.seen.items(), key=lambda kv: kv[1].at_ms))  # age order
            ledger.prune(now)

    def revoked(self, tps: set[TopicPartition]) -> None:
        self.owned -= tps
        for tp in tps:
            ledger = self.ledgers.get(tp.partition)
            if ledger is not None:
                ledger.replay_end.pop(tp.topic, None)
                ledger.direct_from.pop(tp.topic, None)
        for index in [i for i in self.ledgers if not any(tp.partition == i for tp in self.owned)]:
            del self.ledgers[index]  # its next take-over rebuilds it from the markers

    def opens(self, rec: ConsumerRecord) -> tuple[str, str, str] | None:
        """(request key, reply topic, id) of an ingress record, for ``recover``."""
        obj = unpack(rec.value, header(rec.headers, CONTENT_TYPE_HEADER))
        who = peek_reply(obj)
        if who is None:
            return None
        owner = self.tenant_of(rec.topic)
        tenant = owner
        if tenant is None:
            given = obj.get("tenant") if isinstance(obj, dict) else None
            tenant = given if isinstance(given, str) and TENANT_RE.fullmatch(given) else "default"
        rid, reply_to = who
        if reply_to is None or self.names.is_internal(reply_to) or \
                (owner is not None and not self.names.in_reply_namespace(reply_to, owner)):
            reply_to = self.default_reply(owner)  # where the router answers a refused reply topic's request
        return request_key(tenant, rid), reply_to, rid

    def entries(self) -> int:
        """Keys the ledgers hold (``mmstream_state_entries{stage="route",kind="keys"}``), the
        ones older than the retention forgotten first."""
        now = now_ms()
        for ledger in self.ledgers.values():
            ledger.prune(now)
        return sum(len(ledger.seen) for ledger in self.ledgers.values())

    # -- one routed request --------------------------------------------------------------

    def decide(self, r: ConsumerRecord, key: str | None, digest: str | None, eligible: bool) -> Action:
        ledger = self.ledgers.get(r.partition)
        if ledger is None or key is None or TopicPartition(r.topic, r.partition) not in self.owned:
            return Action.ASSEMBLER
        action = ledger.decide(r.topic, key, digest, r.offset, eligible, now_ms())
        if action is Action.DROP and key not in ledger.seen:  # a replay answered before: its place is kept
            ledger.note(key, digest, now_ms(), direct=True)
        elif action in (Action.DIRECT, Action.ASSEMBLER):
            ledger.note(key, digest, now_ms(), direct=action is Action.DIRECT)
        return action

    def declined(self, r: ConsumerRecord, key: str, digest: str | None) -> None:
        """The router's encoder did not take the job of a request meant for a direct answer."""
        ledger = self.ledgers.get(r.partition)
        if ledger is not None:
            ledger.note(key, digest, now_ms(), direct=False)

    def refusal(self, m: Manifest | Verdict) -> list[Out]:
        """The answer to a request reusing the id of one the router answered (from its
        manifest, or from the router's own verdict on it)."""
        self.metrics.request_done("assemble", "error", str(ErrorCode.INVALID_REQUEST))
        return [out_map(m.reply_to, m.id, reused_id(m, now_ms()).to_wire())]

    def joint(self, io: Any, r: ConsumerRecord, epoch: int, m: Manifest, key: str) -> DirectJoint:
        later: list[Callable[[], Any]] = []
        return DirectJoint(io, r, epoch, lambda out: self.answer(r, m, key, out, later.append),
                           lambda: self.declined(r, key, m.digest),
                           lambda: [asyncio.ensure_future(store()) for store in later])

    def answer(self, r: ConsumerRecord, m: Manifest, key: str, out: Out,
               later: Callable[[Callable[[], Any]], None]) -> list[Out]:
        """The records of request ``m``'s answer, from its one encoded part's record. Its
        whole-result store is handed to ``later`` (the joint starts it once the answer is with
        the broker; on this VM a Redis write ahead of the answer's produce cost its client about
        a millisecond: docs/capacity.md, "Stop 50")."""
        now = now_ms()
        try:
            part = fan_in_from_wire(unpack(out.value))
            if not isinstance(part, EncodedPart):
                raise ValueError(f"the encoder answered with a {type(part).__name__}")
            state = step(None, m, now, self.policy, lane=m.lane).state
            done = step(state, part, now, self.policy, lane=m.lane)
            if done.emit is None or done.state is None:
                raise ValueError("the part did not complete its request")
            event, status = done.emit, done.state.status
            observe_terminal(self.metrics, event, m)
        except Exception as exc:  # a bug costs this request an error, never its record
            self.failures += 1
            log.exception("router: the direct answer of %s failed", m.id)
            err = WireError(ErrorCode.INTERNAL, f"the router could not answer: {exc!r}")
            event, status = Event(m.id, EventKind.ERROR, TERMINAL_SEQ, now, error=err.to_wire()), RequestStatus.FAILED
            self.metrics.request_done("assemble", "error", str(ErrorCode.INTERNAL))
        if self.results is not None and m.result_key and m.nonce is not None and status == RequestStatus.FINISHED:
            results, result_key, payload = self.results, m.result_key, event.payload or {}
            later(lambda: results.put(result_key, payload))
        marker = done_marker(self.names.router_done, key, m.reply_to, now, m.digest)
        return [out_map(m.reply_to, m.id, accepted_event(m).to_wire()), out_map(m.reply_to, m.id, event.to_wire()),
                Out(marker.topic, marker.key, marker.value, marker.headers, r.partition % self.done_partitions)]


def eligible(task: str, n_parts: int, outs: Sequence[Out], local_jobs: int) -> bool:
    """An embed request with one part, routed to one job that the router's encoder may take
    (its manifest and that job are all it sends)."""
    return task == "embed" and n_parts == 1 and local_jobs == 1 and len(outs) == 2
