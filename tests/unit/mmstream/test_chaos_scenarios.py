"""Chaos scenarios are data checked before anything starts, and the wire checks count what
the reply topic says: lost, repeated terminals, repeated accepted and token seq."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmstream.chaos.checks import Wire, summarize_latency, wire_violations
from mmstream.chaos.scenario import ScenarioError, load, parse
from mmstream.chaos.traffic import plan

SCENARIOS = Path(__file__).resolve().parents[3] / "chaos" / "scenarios"
BASE = {"name": "x", "pipeline": {"replicas": {"router": 1}}, "traffic": {"seconds": 2, "rate": 2, "mix": {"text": 1}}}


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.json")), ids=lambda p: p.stem)
def test_every_scenario_file_loads(path: Path) -> None:
    s = load(path)
    assert s.name == path.stem and s.faults and s.replicas


def test_faults_on_shared_infrastructure_are_refused() -> None:
    for action in ("broker_kill", "kill_leader", "redis_kill", "redis_evict"):
        with pytest.raises(ScenarioError, match="never the shared"):
            parse({**BASE, "faults": [{"at_s": 1, "action": action}]})
    with pytest.raises(ScenarioError, match="proxy"):
        parse({**BASE, "faults": [{"at_s": 1, "action": "cut", "link": "kafka", "for_s": 1}]})
    with pytest.raises(ScenarioError, match="needs for_s"):
        parse({**BASE, "faults": [{"at_s": 1, "action": "stall", "stage": "router"}]})
    with pytest.raises(ScenarioError, match="traffic.mix"):
        parse({**BASE, "traffic": {"seconds": 1, "rate": 1, "mix": {"smell": 1}}})


def test_traffic_is_the_same_for_the_same_seed() -> None:
    s = parse({**BASE, "traffic": {"seconds": 10, "rate": 3, "mix": {"text": 1, "generate": 1}, "bulk_share": 0.5}})
    assert plan(s) == plan(s) and len(plan(s)) == 30
    assert {lane for _, _, lane in plan(s)} == {"rt", "bulk"}


def test_wire_violations_count_lost_duplicated_and_repeated_seq() -> None:
    wire = Wire()
    wire.terminals.update({"a": 1, "b": 2})
    wire.accepted.update({"a": 1, "b": 2})
    wire.tokens.update({("b", 1): 2, ("b", 2): 1})
    wire.errors.update({"deadline_exceeded": 1})
    violations, lost, duplicated = wire_violations(wire, ["a", "b", "c"], ())
    assert (lost, duplicated) == (1, 1)
    text = " ".join(violations)
    for expected in ("no terminal", "more than one terminal", "`accepted` more than once", "token events repeated",
                     "deadline_exceeded"):
        assert expected in text
    assert wire_violations(wire, ["a"], ("deadline_exceeded",))[0] == ["1 requests got `accepted` more than once (e.g. b)",
                                                                      "1 token events repeated a (request, seq) (e.g. ('b', 1))"]


def test_latency_during_faults_and_time_to_recover() -> None:
    class S:
        def __init__(self, sent: float, answered: float | None) -> None:
            self.sent_at, self.answered_at = sent, answered

    sent = [S(0.0, 0.1), S(5.0, 9.0), S(6.0, 7.0), S(20.0, 20.1)]
    p99, recover = summarize_latency(sent, [(4.0, 8.0)])
    assert p99 == pytest.approx(4000.0) and recover == pytest.approx(1.0)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.json")), ids=lambda p: p.stem)
def test_a_fault_scenario_with_generate_traffic_checks_faults_not_admission(path: Path) -> None:
    """A take-over or a restart releases a burst at the survivors; at the 1 s rt TTFT bound
    the generator rightly sheds part of it as overloaded, which is admission working, not a
    fault lost. A scenario that allows no overloaded answer must lift the bound (CI once went
    red on one shed in ci-kill, the only scenario that had not)."""
    s = load(path)
    if not s.mix.get("generate") or "overloaded" in s.errors:
        return
    bound = int(s.env.get("MMSTREAM_GENERATOR_TTFT_BOUND_MS", "1000"))
    assert bound == 0 or bound >= 10_000, \
        f"{path.name}: generate traffic, no overloaded allowed, and the TTFT bound left at its 1 s default"


def test_documents_of_a_scenario_end_as_the_compacted_topic_would_hold_them() -> None:
    from mmstream.chaos.ingest import Ingest, live, plan

    spec = Ingest("kb", 60, 6.0, seed=3)
    ops = plan(spec)
    assert plan(spec) == ops and len(ops) == 60 + 20 + 20  # puts, a third rewritten, a third deleted
    want = live(ops)
    deleted = {d for d, text in ops if text is None}
    assert len(want) == 40 and not deleted & set(want)
    assert sum(t.startswith("Rewritten") for t in want.values()) == 20
    assert live([("a", "x"), ("a", None), ("a", "y")]) == {"a": "y"}  # put again after a delete: live
    with pytest.raises(ScenarioError):
        parse({"name": "x", "pipeline": {"replicas": {}}, "traffic": {"seconds": 1, "rate": 1, "mix": {"text": 1}},
               "documents": {"count": 200}})
