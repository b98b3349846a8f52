"""The assembler's decisions before a request's ``step`` (``streams.policies.assembly.intake``):
late duplicates, reused ids, the router's own answers, the open-request bound and room for a
new orphan, from a plain view of the key."""

from __future__ import annotations

import dataclasses

import pytest

from schemas.jobs import DeadlineTick, Verdict
from streams.policies.assembly import Intake, KeyView, intake
from tests.unit.streams.test_assembly import manifest, part


def _m(digest):
    return dataclasses.replace(manifest(), digest=digest)


def _v(digest):
    return Verdict(id="r", tenant="t", lane="rt", reply_to="mm.results", events=[], sent_at_ms=1.0, digest=digest)


def _do(msg, max_pending=10, max_orphans=10, **view):
    return intake(msg, KeyView(**view), max_pending, max_orphans)


def test_a_deadline_tick_from_the_wire_is_ignored_the_sweep_keeps_deadlines() -> None:
    assert _do(DeadlineTick("r")).action is Intake.IGNORE


@pytest.mark.parametrize("make", [_m, _v], ids=["manifest", "verdict"])
def test_after_the_answer_the_same_record_is_a_duplicate_and_another_record_reuses_the_id(make) -> None:
    assert _do(make("d1"), answered=True, answered_digest="d1").action is Intake.IGNORE
    assert _do(make("d2"), answered=True, answered_digest="d1").action is Intake.REUSED_ID
    assert _do(part(0), answered=True, answered_digest="d1").action is Intake.IGNORE  # a late part


def test_the_routers_answer_to_an_open_request_stands_only_for_the_same_record() -> None:
    open_ = dict(tracked=True, has_manifest=True, manifest_digest="d1")
    assert _do(_v("d1"), **open_).action is Intake.IGNORE  # a replay the router answered itself
    assert _do(_v("d2"), **open_).action is Intake.REUSED_ID
    assert _do(_v("d2"), tracked=True).action is Intake.VERDICT  # over orphans only: the verdict answers
    assert _do(_v("d2")).action is Intake.VERDICT


def test_a_manifest_that_would_open_one_request_too_many_is_overloaded() -> None:
    assert _do(_m("d"), max_pending=2, open_requests=2) == _do(_m("d"), max_pending=2, open_requests=5)
    assert _do(_m("d"), max_pending=2, open_requests=2).action is Intake.OVERLOADED
    assert _do(_m("d"), max_pending=2, open_requests=1).action is Intake.STEP
    # A second manifest of an open request opens nothing: the bound does not apply.
    again = _do(_m("d"), max_pending=2, open_requests=2, tracked=True, has_manifest=True, manifest_digest="d")
    assert again.action is Intake.STEP and not again.opens
    # A manifest whose parts came first (an orphan entry) opens the request.
    assert _do(_m("d"), tracked=True, open_requests=0).opens


def test_a_new_orphan_past_the_bound_makes_room_first_and_a_known_key_never_does() -> None:
    assert _do(part(0), max_orphans=3, orphans=3).evict_orphan
    assert not _do(part(0), max_orphans=3, orphans=2).evict_orphan
    assert not _do(part(0), max_orphans=3, orphans=3, tracked=True).evict_orphan  # its entry exists already
    assert not _do(_m("d"), max_orphans=3, orphans=3).evict_orphan  # a manifest is no orphan
