"""The router's direct answers (``router.answer_local``): which requests it answers itself, how
it keeps out of the assembler's way (duplicates, reused ids, replays after a take-over), and
the records of an answer. The I/O is ``test_joint``'s stand-in for ``StageIO``: what is
tested is the bookkeeping and the records, not Kafka (tests/integration/test_direct_answers.py
runs it on the real pipeline)."""

import dataclasses

import msgpack
import numpy as np
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import pack, unpack
from schemas.jobs import EncodedPart, Manifest
from schemas.tensor import to_wire
from schemas.topics import TopicNames
from schemas.trace import now_ms
from streams.policies.assembly import AssemblyPolicy, step
from streams.policies.direct import Action, Ledger, Seen, decide
from streams.runtime.produce import out_map
from streams.runtime.recovery import Recovered
from streams.stages.direct import DirectAnswers, eligible
from tests.unit.streams.test_joint import Deliveries, settle

NAMES = TopicNames("mm")
TP = TopicPartition("mm.ingress.rt", 1)


class Counts:
    def __init__(self) -> None:
        self.done: list[tuple] = []
        self.e2e: list[tuple] = []

    def request_done(self, *args) -> None:
        self.done.append(args)

    def observe_e2e(self, *args) -> None:
        self.e2e.append(args)

    def observe_span(self, *args) -> None:
        pass


def manifest(rid: str = "r", digest: str = "d1") -> Manifest:
    return Manifest(id=rid, task="embed", tenant="t", lane="rt", reply_to="mm.results", n_parts=1,
                    modalities=["text"], deadline_at_ms=1e15, accepted_at_ms=1.0, client_sent_at_ms=0.0,
                    sent_at_ms=1.0, trace=[["route", 0.0, 0.5, 1.0]], nonce="n1", digest=digest)


def part_out(rid: str = "r", nonce: str = "n1"):
    p = EncodedPart(id=rid, part=0, modality="text", sent_at_ms=5.0, embedding=to_wire(np.ones(4)),
                    trace=[["encode.text", 1.0, 2.0, 4.0]], tenant="t", nonce=nonce)
    return out_map("mm.encoded.rt", f"t/{rid}", p.to_wire())


def record(offset: int) -> ConsumerRecord:
    return ConsumerRecord(TP.topic, TP.partition, offset, 0, 0, None, b"", None, 0, 0, [])


def answers(found: Recovered | None = None) -> tuple[DirectAnswers, Counts]:
    metrics = Counts()
    d = DirectAnswers(NAMES, metrics, None, 120_000.0, lambda tenant: "mm.results", lambda topic: None)
    d.done_partitions = 2
    d.assigned({TP}, found if found is not None else Recovered(ends={TP: 0}))
    return d, metrics


# -- the decision, pure ----------------------------------------------------------------------

@pytest.mark.parametrize("prev, digest, replayed, answered_before, eligible_, expected", [
    (None, "a", False, False, True, Action.DIRECT),
    (None, "a", False, False, False, Action.ASSEMBLER),
    (Seen(0.0, "a", True), "a", False, False, True, Action.DROP),  # a duplicate of one answered here
    (Seen(0.0, "a", True), "b", False, False, True, Action.REUSED),  # another request, the same id
    (Seen(0.0, "a", True), "b", True, True, False, Action.REUSED),
    (Seen(0.0, "a", False), "a", False, False, True, Action.ASSEMBLER),  # the assembler's: it dedups
    (Seen(0.0, "a", False), "b", False, False, True, Action.ASSEMBLER),  # and refuses a reused id
    (None, "a", True, False, True, Action.ASSEMBLER),  # a replay is never answered here
    (None, "a", True, True, True, Action.DROP),  # its answer is on its reply topic already
])
def test_the_decision(prev, digest, replayed, answered_before, eligible_, expected):
    assert decide(prev, digest, replayed=replayed, answered_before=answered_before, eligible=eligible_) is expected


def test_a_key_older_than_the_retention_is_forgotten_before_the_decision():
    ledger = Ledger(retention_ms=100.0, max_keys=10)
    ledger.note("a", "1", 0.0, True)
    assert ledger.decide("t", "a", "2", 5, True, now_ms=50.0) is Action.REUSED
    assert ledger.decide("t", "a", "2", 5, True, now_ms=150.0) is Action.DIRECT  # as the assembler forgot it


def test_the_keys_gauge_counts_what_is_left_after_the_retention():
    d, _ = answers()
    d.ledgers[TP.partition].note("t/old", "1", now_ms() - 200_000.0, True)
    d.ledgers[TP.partition].note("t/new", "1", now_ms(), True)
    assert d.entries() == 1  # read on a quiet partition too: the chaos suite checks it empties


def test_a_ledger_forgets_by_age_and_by_count():
    ledger = Ledger(retention_ms=100.0, max_keys=2)
    ledger.note("a", "1", 0.0, True)
    ledger.note("b", "1", 50.0, True)
    ledger.note("c", "1", 60.0, True)  # past max_keys: the oldest goes
    assert list(ledger.seen) == ["b", "c"]
    ledger.prune(155.0)  # b is 105 ms old
    assert list(ledger.seen) == ["c"]


def test_only_one_part_embed_requests_with_one_local_job_qualify():
    two = [out_map("x", "k", {}), out_map("y", "k", {})]
    assert eligible("embed", 1, two, 1)
    assert not eligible("generate", 1, two, 1)
    assert not eligible("embed", 2, [*two, out_map("z", "k", {})], 2)
    assert not eligible("embed", 1, two, 0)  # its job goes through the topic
    assert not eligible("embed", 1, [*two, out_map("e", "k", {})], 1)  # a part that failed alone rides along


# -- the records of an answer ------------------------------------------------------------------

def test_the_answer_is_the_assemblers_with_a_marker_on_the_ingress_partition():
    d, metrics = answers()
    m = manifest()
    outs = d.answer(record(7), m, "t/r", part_out(), [].append)
    accepted, result, marker = outs
    assert [o.topic for o in outs] == ["mm.results", "mm.results", "mm.router.done"]
    assert accepted.key == result.key == b"r"
    assert unpack(accepted.value)["kind"] == "accepted"
    got = unpack(result.value)
    policy = AssemblyPolicy(retention_ms=120_000.0)
    want = step(step(None, m, 10.0, policy).state, EncodedPart.from_wire(unpack(part_out().value)), 10.0, policy).emit
    assert got["kind"] == "result" and got["seq"] == want.seq
    assert got["payload"]["parts"][0]["embedding"] == want.payload["parts"][0]["embedding"]
    assert [s["stage"] for s in got["timings"]["stages"]] == ["route", "encode.text", "assemble"]
    assert marker.key == b"t/r" and marker.partition == TP.partition
    assert msgpack.unpackb(marker.value)["d"] == "d1"
    assert metrics.done == [("assemble", "ok")] and len(metrics.e2e) == 1


def test_a_marker_goes_to_the_ingress_index_modulo_the_done_topics_partitions():
    d, _ = answers()
    d.done_partitions = 1  # a tenant's ingress topic made after kafka.partitions grew
    assert d.answer(record(7), manifest(), "t/r", part_out(), [].append)[2].partition == 0


def test_a_part_that_cannot_answer_its_request_costs_an_error_never_the_record():
    d, metrics = answers()
    forged = d.answer(record(7), manifest(), "t/r", part_out(nonce="other"), [].append)  # not this request's part
    broken = d.answer(record(8), manifest(), "t/r", out_map("mm.encoded.rt", "t/r", {"type": "nonsense"}), [].append)
    for outs in (forged, broken):
        assert [o.topic for o in outs] == ["mm.results", "mm.results", "mm.router.done"]
        terminal = unpack(outs[1].value)
        assert terminal["kind"] == "error" and terminal["error"]["code"] == "internal"
    assert d.failures == 2


def test_a_reused_id_is_refused_in_its_own_error():
    d, _ = answers()
    (refusal,) = d.refusal(manifest(digest="d2"))
    ev = unpack(refusal.value)
    assert ev["kind"] == "error" and ev["error"]["code"] == "invalid_request" and ev["error"]["field"] == "id"


# -- the ledger of a partition, through the stage's calls ----------------------------------------

def test_the_stage_notes_what_it_decided():
    d, _ = answers()
    assert d.decide(record(1), "t/a", "d1", True) is Action.DIRECT
    assert d.decide(record(2), "t/a", "d1", True) is Action.DROP
    assert d.decide(record(3), "t/a", "d2", True) is Action.REUSED
    assert d.decide(record(4), "t/b", "d1", False) is Action.ASSEMBLER
    assert d.decide(record(5), "t/b", "d2", True) is Action.ASSEMBLER  # the assembler's key stays its own
    assert d.decide(record(6), "t/c", "d1", True) is Action.DIRECT
    d.declined(record(6), "t/c", "d1")  # the encoder did not take it: it went the assembler's way
    assert d.decide(record(7), "t/c", "d1", True) is Action.ASSEMBLER
    other = ConsumerRecord("mm.ingress.rt", 0, 1, 0, 0, None, b"", None, 0, 0, [])
    assert d.decide(other, "t/z", "d1", True) is Action.ASSEMBLER  # a partition not (yet) taken over


def test_a_take_over_replays_through_the_assembler_and_drops_what_was_answered():
    found = Recovered(done={TP: {"t/marked": now_ms() - 1000.0}}, digests={"t/marked": "d1"}, ends={TP: 10},
                      sent={"t/sent": {("terminal", 1)}, "t/half": {("accepted", 0)}})
    d, _ = answers(found)
    # Replayed records (offsets under 10).
    assert d.decide(record(3), "t/marked", "d1", True) is Action.DROP  # its marker landed
    assert d.decide(record(4), "t/marked", "d9", True) is Action.REUSED
    assert d.decide(record(5), "t/sent", "d1", True) is Action.DROP  # its answer landed, its marker not
    assert d.decide(record(6), "t/sent", "d2", True) is Action.REUSED  # a second record with that id
    assert d.decide(record(7), "t/half", "d1", True) is Action.ASSEMBLER  # only accepted: the assembler's
    assert d.decide(record(8), "t/new", "d1", True) is Action.ASSEMBLER
    # Past the replay: answered here again.
    assert d.decide(record(10), "t/fresh", "d1", True) is Action.DIRECT


def test_after_taking_over_a_busy_partition_nothing_is_answered_directly_for_one_retention():
    metrics = Counts()
    d = DirectAnswers(NAMES, metrics, None, 120_000.0, lambda tenant: "mm.results", lambda topic: None)
    tenant_tp = TopicPartition("mm.ingress.rt.acme", TP.partition)
    found = Recovered(done={TP: {"t/marked": now_ms() - 1000.0}, tenant_tp: {"t/marked": now_ms() - 1000.0}},
                      digests={"t/marked": "d1"}, ends={TP: 10, tenant_tp: 0},
                      unseen={TP})  # the last owner handled records of TP in the last retention; of the tenant's none
    d.assigned({TP, tenant_tp}, found)
    # The last owner's keys that went the assembler's way are unknown here: the assembler's they stay.
    assert d.decide(record(10), "t/new", "d1", True) is Action.ASSEMBLER
    # Its own markers still hold, for every topic of the partition index.
    assert d.decide(record(11), "t/marked", "d2", True) is Action.REUSED
    tenant_record = ConsumerRecord(tenant_tp.topic, tenant_tp.partition, 0, 0, 0, None, b"", None, 0, 0, [])
    assert d.decide(tenant_record, "acme/q", "d1", True) is Action.DIRECT
    assert d.decide(tenant_record, "t/marked", "d1", True) is Action.DROP
    assert len(d.ledgers) == 1  # one ledger per partition index, whatever the topics
    d.ledgers[TP.partition].direct_from[TP.topic] = now_ms() - 1.0  # one retention later
    assert d.decide(record(12), "t/later", "d1", True) is Action.DIRECT
    d.revoked({TP})
    assert d.decide(record(13), "t/gone", "d1", True) is Action.ASSEMBLER  # not ours any more
    assert d.decide(tenant_record, "acme/q2", "d1", True) is Action.DIRECT


def test_a_failed_take_over_answers_nothing_directly():
    metrics = Counts()
    d = DirectAnswers(NAMES, metrics, None, 120_000.0, lambda tenant: "mm.results", lambda topic: None)
    d.assigned({TP}, None)
    assert d.decide(record(10 ** 9), "t/a", "d1", True) is Action.ASSEMBLER
    d.revoked({TP})
    assert d.ledgers == {}


# -- the joint: the answer instead of the manifest ---------------------------------------------

def held(d, offset):
    """A joint of ``d`` for a fresh ingress record at ``offset``, holding its manifest."""
    io, m, rec = Deliveries(), manifest(), record(offset)
    joint = d.joint(io, rec, 0, m, "t/r")
    joint.hold([out_map("mm.encoded.rt", "t/r", m.to_wire())])
    return io, rec, joint

async def test_a_taken_job_sends_the_answer_and_never_the_manifest():
    d, _ = answers()
    io, rec, joint = held(d, 11)
    send = joint.expect()
    joint.seal()
    assert io.sent == []
    send(part_out())
    assert [o.topic for o in io.sent[0][0]] == ["mm.results", "mm.results", "mm.router.done"]
    io.land(0)
    await settle()
    assert io.finished == [rec] and len(io.sent) == 1


class _Results:
    """A whole-result store that records what it was given."""

    def __init__(self) -> None:
        self.stored: list[str] = []

    async def put(self, key, payload) -> None:
        self.stored.append(key)


async def test_the_whole_result_is_stored_once_the_answer_is_with_the_broker_and_only_then():
    results = _Results()
    d = DirectAnswers(NAMES, Counts(), results, 120_000.0, lambda tenant: "mm.results", lambda topic: None)
    d.done_partitions = 2
    d.assigned({TP}, Recovered(ends={TP: 0}))
    for offset, landed in ((11, True), (12, False)):
        io, rec = Deliveries(), record(offset)
        m = dataclasses.replace(manifest(f"r{offset}"), result_key=f"k{offset}")
        joint = d.joint(io, rec, 0, m, f"t/r{offset}")
        joint.hold([out_map("mm.encoded.rt", f"t/r{offset}", m.to_wire())])
        send = joint.expect()
        joint.seal()
        send(part_out(f"r{offset}"))
        await settle()
        assert [o.topic for o in io.sent[0][0]] == ["mm.results", "mm.results", "mm.router.done"]
        assert results.stored == ([] if offset == 11 else ["k11"])  # nothing stored ahead of the answer
        io.land(0, landed)
        await settle()
    assert results.stored == ["k11"]  # the answer that never reached the broker stored nothing


async def test_a_declined_job_goes_the_assemblers_way_with_its_manifest():
    d, _ = answers()
    assert d.decide(record(12), "t/r", "d1", True) is Action.DIRECT
    io, rec, joint = held(d, 12)
    joint.expect()
    joint.unexpect()
    joint.send([out_map("mm.encode.text.rt", "t/r", {"job": 1})])
    joint.seal()
    assert [o.topic for o in io.sent[0][0]] == ["mm.encoded.rt", "mm.encode.text.rt"]
    io.land(0)
    await settle()
    assert io.finished == [rec]
    assert d.ledgers[TP.partition].seen["t/r"].direct is False


def test_opens_names_the_request_of_an_ingress_record():
    d, _ = answers()
    raw = pack({"id": "q1", "tenant": "acme", "parts": []})
    rec = ConsumerRecord(TP.topic, 1, 3, 0, 0, b"q1", raw, None, 0, len(raw), [])
    assert d.opens(rec) == ("acme/q1", "mm.results", "q1")
    secure = DirectAnswers(NAMES, Counts(), None, 1.0, lambda tenant: f"mm.results.{tenant}",
                           lambda topic: "globex")
    assert secure.opens(rec) == ("globex/q1", "mm.results.globex", "q1")  # the topic's tenant, never the payload's
    assert d.opens(dataclasses.replace(rec, value=pack({"no": "id"}))) is None
    # A reply topic the router would refuse is not read on a take-over: the router answered on the default.
    internal = dataclasses.replace(rec, value=pack({"id": "q1", "reply_to": "mm.assembler.done"}))
    assert d.opens(internal) == ("default/q1", "mm.results", "q1")
    foreign = dataclasses.replace(rec, value=pack({"id": "q1", "reply_to": "mm.results.initech"}))
    assert secure.opens(foreign) == ("globex/q1", "mm.results.globex", "q1")
    own = dataclasses.replace(rec, value=pack({"id": "q1", "reply_to": "mm.results.globex.mine"}))
    assert secure.opens(own) == ("globex/q1", "mm.results.globex.mine", "q1")


async def test_an_answer_that_cannot_be_built_goes_the_assemblers_way_with_its_manifest():
    d, _ = answers()
    io, rec, joint = held(d, 13)

    def broken(out):
        raise RuntimeError("a bug past answer()'s own error path")

    joint.answer = broken
    send = joint.expect()
    joint.seal()
    send(part_out())
    assert [o.topic for o in io.sent[0][0]] == ["mm.encoded.rt", "mm.encoded.rt"]  # manifest, part: the assembler's
    io.land(0)
    await settle()
    assert io.finished == [rec]  # never a record held for good
