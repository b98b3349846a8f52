"""What an answering stage (generator, retrieve) remembers across take-overs, without a broker:
the done marker goes with every last answer, an event a previous owner sent is not sent again,
answered requests are remembered for the retention and no longer."""

from __future__ import annotations

import msgpack

from streams.runtime.produce import Out
from streams.runtime.recovery import AnswerLedger, Recovered, stage_timings


def _out(topic: str) -> Out:
    return Out(topic, b"r1", b"x")


def test_the_last_answer_carries_its_done_marker_and_the_request_counts_as_answered() -> None:
    ledger = AnswerLedger("mm.generator.done", retention_ms=1000.0)
    outs = ledger.finish("t/r1", "mm.results", [_out("mm.results")], terminal_seq=3, now_ms=50.0)
    assert [o.topic for o in outs] == ["mm.results", "mm.generator.done"]
    marker = msgpack.unpackb(outs[1].value)
    assert outs[1].key == b"t/r1" and marker == {"r": "mm.results", "t": 50.0}
    assert ledger.answered("t/r1") and not ledger.answered("t/r2")


def test_what_a_previous_owner_sent_is_not_sent_again_but_other_records_are() -> None:
    ledger = AnswerLedger("mm.retrieve.done", retention_ms=1000.0)
    ledger.take_over(Recovered(done={}, sent={"t/r1": {("terminal", 1), ("token", 1)}}))
    assert ledger.already_sent("t/r1", "token", 1) and not ledger.already_sent("t/r1", "token", 2)
    outs = ledger.finish("t/r1", "mm.results", [_out("mm.results"), _out("mm.generate.rt")], 1, 10.0)
    assert [o.topic for o in outs] == ["mm.generate.rt", "mm.retrieve.done"]  # the forward still goes
    assert not ledger.already_sent("t/r1", "token", 1)  # forgotten once answered


def test_answered_requests_are_forgotten_after_the_retention_oldest_first() -> None:
    ledger = AnswerLedger("mm.generator.done", retention_ms=100.0)
    ledger.take_over(Recovered(done={"p0": {"t/old": 0.0, "t/mid": 60.0}}))  # type: ignore[dict-item]
    ledger.finish("t/new", "mm.results", [], 1, now_ms=150.0)
    assert not ledger.answered("t/old") and ledger.answered("t/mid") and ledger.answered("t/new")
    ledger.prune(now_ms=200.0)
    assert list(ledger.done) == ["t/new"]


def test_stage_timings_add_this_stage_to_the_trace() -> None:
    class Job:
        trace = [{"stage": "route", "queued_ms": 1.0, "service_ms": 2.0}]
        sent_at_ms, client_sent_at_ms, accepted_at_ms = 100.0, 90.0, 95.0

    t = stage_timings(Job(), "generate", started_ms=104.0, now_ms=110.0)
    assert t["e2e_ms"] == 20.0 and t["accepted_at_ms"] == 95.0
    assert t["stages"][-1] == {"stage": "generate", "queued_ms": 4.0, "service_ms": 6.0} and len(t["stages"]) == 2
