"""The output tokens a generation was charged for and did not make are owed back to its tenant
only once its terminal event and done marker are with the broker: a job replayed after a
generator died before that owes them once, in its replay, and never twice."""

from __future__ import annotations

import asyncio

from streams.stages.generator import GeneratorStage


async def test_tokens_are_owed_only_once_the_answer_is_delivered_and_never_for_one_dropped() -> None:
    stage = GeneratorStage.__new__(GeneratorStage)  # only its ledger of what is owed
    stage.credits = {}
    loop = asyncio.get_running_loop()
    delivered, revoked, failed, pending = (loop.create_future() for _ in range(4))
    stage._credit("router/1", "a", 500, delivered)
    stage._credit("router/1", "a", 7, revoked)
    stage._credit(None, "b", 3, failed)
    stage._credit("router/2", "c", 9, pending)
    assert stage.credits == {}  # nothing owed while the answers are in flight
    delivered.set_result(True)
    revoked.set_result(False)  # the partition went to another generator: it replays the job, and owes it
    failed.set_exception(RuntimeError("a bug in delivery"))
    await asyncio.sleep(0)
    assert stage.credits == {("router/1", "a"): 500}
    pending.cancel()  # the stage stopped first
    await asyncio.sleep(0)
    assert stage.credits == {("router/1", "a"): 500}
