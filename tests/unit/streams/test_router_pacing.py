"""The router on an authenticating broker holds a tenant's ingress topics past its large-record
bytes, or past its rate of refusals, while another tenant's records come too (``streams.policies.pacing``), and takes them
again when the hold ends, unless one of its gates holds them. The runtime's I/O is a recorder:
what is tested is which topics the stage pauses and resumes."""

from __future__ import annotations

import time

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.settings import Settings
from schemas.topics import TopicNames
from streams.app import create_app
from streams.observe.health import WorkerHealth
from streams.observe.metrics import Metrics
from streams.stages.router import RouterStage
from streams.stages.routing import Routed

PREFIX = "unit"
NAMES = TopicNames(PREFIX)
SECURE = {"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
          "MMSTREAM_KAFKA_USERNAME": "svc", "MMSTREAM_KAFKA_PASSWORD": "secret"}


class Recorder:
    """Stands in for StageIO: the assignment, and the topics paused."""

    def __init__(self, topics):
        self.tps = {TopicPartition(t, p) for t in topics for p in range(2)}
        self.paused: set[str] = set()

    def assignment(self):
        return set(self.tps)

    def pause(self, topic):
        self.paused.add(topic)

    def resume(self, topic):
        self.paused.discard(topic)


def _stage(tmp_path, **env):
    settings = Settings.from_env({**SECURE, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path), **env})
    stage = RouterStage(create_app(settings, "router", health=WorkerHealth()), settings, Metrics(health=WorkerHealth()))
    stage.io = Recorder([NAMES.tenant_ingress(lane, t) for lane in ("rt", "bulk") for t in ("a", "b")])
    return stage


def _record(tenant: str, size: int, lane: str = "rt") -> ConsumerRecord:
    return ConsumerRecord(NAMES.tenant_ingress(lane, tenant), 0, 0, 0, 0, None, b"", None, 0, size, [])


def test_a_tenant_past_its_large_record_bytes_waits_while_another_is_served_and_comes_back(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_LARGE_RECORD_BYTES_PER_S=str(1024 * 1024))
    assert stage.pacing is not None
    a = {NAMES.tenant_ingress("rt", "a"), NAMES.tenant_ingress("bulk", "a")}
    stage._pace([_record("a", 1024 * 1024), _record("b", 500)])  # noqa: SLF001 - a second's worth: not yet
    assert stage.io.paused == set()
    stage._pace([_record("a", 1024 * 1024), _record("a", 1024 * 1024, "bulk")])  # noqa: SLF001
    assert stage.io.paused == a and set(stage.paced) == {"a"}  # both lanes of a; b's untouched
    stage.bulk_paused = True
    stage.bulk_gate(False)  # the rt-first gate opening must not let a's records in early
    assert stage.io.paused == a
    stage._release_paced()  # noqa: SLF001 - the hold has not ended
    assert stage.io.paused == a
    stage.paced["a"] = 0.0  # it has
    stage.bulk_paused = True
    stage._release_paced()  # noqa: SLF001
    assert stage.io.paused == {NAMES.tenant_ingress("bulk", "a")} and not stage.paced  # bulk's gate still holds it


def test_no_pacing_where_tenants_share_the_ingress_or_it_is_off(tmp_path):
    plain = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    assert RouterStage(create_app(plain, "router", health=WorkerHealth()), plain,
                       Metrics(health=WorkerHealth())).pacing is None
    assert _stage(tmp_path, MMSTREAM_ROUTER_LARGE_RECORD_BYTES_PER_S="0").pacing is None


def test_a_rebalance_does_not_end_a_hold_early(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_LARGE_RECORD_BYTES_PER_S=str(1024 * 1024))
    a = {NAMES.tenant_ingress("rt", "a"), NAMES.tenant_ingress("bulk", "a")}
    stage._pace([_record("a", 3 * 1024 * 1024), _record("b", 500)])  # noqa: SLF001 - two seconds owed
    assert stage.io.paused == a
    stage.io.paused.clear()  # a rebalance hands the partitions back unpaused
    stage._release_paced()  # noqa: SLF001 - before the next poll: still held
    assert stage.io.paused == a


def test_holds_are_counted_per_tenant_with_their_length(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_LARGE_RECORD_BYTES_PER_S=str(1024 * 1024))
    reg = stage.metrics.registry
    stage._pace([_record("a", 1024 * 1024 + 512 * 1024), _record("b", 500)])  # noqa: SLF001 - half a second owed
    stage._pace([_record("a", 512 * 1024)])  # noqa: SLF001 - the same hold, half a second longer
    large = {"tenant": "a", "reason": "large_records"}
    assert reg.get_sample_value("mmstream_tenant_paced_total", large) == 1
    assert abs(reg.get_sample_value("mmstream_tenant_paced_seconds_total", large) - 1.0) < 0.05
    assert reg.get_sample_value("mmstream_tenant_paced_total", {"tenant": "b", "reason": "large_records"}) is None


def _shed(tenant: str) -> Routed:
    return Routed([], "error", "overloaded", shed=(tenant, "compute"))


def test_a_tenant_refused_past_its_rate_of_refusals_waits_while_another_is_served(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_REFUSED_PER_S="10")
    assert stage.refusals is not None
    a = {NAMES.tenant_ingress("rt", "a"), NAMES.tenant_ingress("bulk", "a")}
    records = [_record("a", 100)] * 10 + [_record("b", 100)]
    stage._pace_refusals(records, [_shed("a")] * 10 + [Routed([], "ok")])  # noqa: SLF001 - a second's worth
    assert stage.io.paused == set()
    stage._pace_refusals(records[:5], [_shed("a")] * 5)  # noqa: SLF001 - b came within the window: a waits
    assert stage.io.paused == a and stage.paced["a"] - time.monotonic() == pytest.approx(0.5, abs=0.05)
    reg = stage.metrics.registry
    assert reg.get_sample_value("mmstream_tenant_paced_total", {"tenant": "a", "reason": "refused"}) == 1


def test_refusals_of_a_tenant_alone_or_answered_requests_hold_no_one(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_REFUSED_PER_S="10")
    stage._pace_refusals([_record("a", 100)] * 50, [_shed("a")] * 50)  # noqa: SLF001 - alone
    stage._pace_refusals([_record("b", 100)] * 50, [Routed([], "ok")] * 50)  # noqa: SLF001 - b is answered
    assert stage.io.paused == set() and not stage.paced
    assert _stage(tmp_path, MMSTREAM_ROUTER_REFUSED_PER_S="0").refusals is None


def test_a_polls_records_are_routed_in_groups(tmp_path):
    """A held tenant's backlog comes back in polls of hundreds: routed all at once, their Redis
    round trips time out behind each other's parsing, and no quota spent by the first stands
    before the last is priced."""
    import asyncio

    from streams.stages.router import ROUTED_AT_ONCE

    stage = _stage(tmp_path)
    stage.io.epoch, delivered = 0, []
    stage.io.deliver = lambda outs, records, epoch: delivered.extend(records)
    running, most = 0, 0

    async def route(record):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1
        return Routed([], "error", "overloaded")

    stage._route = route  # noqa: SLF001
    records = [_record("a", 100)] * (3 * ROUTED_AT_ONCE + 1)
    asyncio.run(stage.handle(records))
    assert most == ROUTED_AT_ONCE and len(delivered) == len(records)


def test_a_held_tenant_is_taken_again_once_no_one_else_is_served(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_REFUSED_PER_S="10")
    stage._pace_refusals([_record("a", 100)] * 30 + [_record("b", 100)], [_shed("a")] * 30)  # noqa: SLF001
    assert stage.paced and stage.io.paused
    stage._release_paced()  # noqa: SLF001 - b was just served: a stays held
    assert stage.io.paused
    for pacer in (stage.pacing, stage.refusals):  # b's last record was long ago
        pacer._seen = {t: at - 10.0 for t, at in pacer._seen.items()}  # noqa: SLF001
        pacer._swept_at -= 10.0  # noqa: SLF001
    stage._release_paced()  # noqa: SLF001
    assert not stage.paced and stage.io.paused == set()


def _numbered(tenant: str, n: int) -> list[ConsumerRecord]:
    return [ConsumerRecord(NAMES.tenant_ingress("rt", tenant), 0, i, 0, 0, None, b"", None, 0, 100, [])
            for i in range(n)]


def test_one_tenants_backlog_is_routed_a_turn_at_a_time_beside_the_others(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_TURN_RECORDS="32")
    stage.io.epoch = 0
    a = {NAMES.tenant_ingress("rt", "a"), NAMES.tenant_ingress("bulk", "a")}
    backlog, b = _numbered("a", 70), _numbered("b", 2)
    turn = stage._turn(backlog + b)  # noqa: SLF001
    assert turn == backlog[:32] + b and stage.io.paused == a  # nothing newer of a is read meanwhile
    assert stage._turn(_numbered("b", 1)) == backlog[32:64] + _numbered("b", 1)  # noqa: SLF001 - oldest first
    stage.paced["a"] = time.monotonic() + 60.0  # held by a pacing meanwhile: what was read of it waits here
    assert stage._turn(_numbered("b", 1)) == _numbered("b", 1) and not stage._deferred_ready()  # noqa: SLF001
    del stage.paced["a"]  # the hold ended: the rest of its backlog goes, then its topics are read again
    assert stage._deferred_ready() and stage._turn([]) == backlog[64:] and stage.io.paused == set()  # noqa: SLF001
    assert not stage.deferred
    stage._turn(_numbered("a", 40))  # noqa: SLF001
    assert stage._turn([]) == _numbered("a", 40)[32:] and stage.io.paused == set()  # noqa: SLF001 - taken again


def test_a_tenant_refused_lately_gets_a_turn_of_what_its_refusal_bucket_holds(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_TURN_RECORDS="32", MMSTREAM_ROUTER_REFUSED_PER_S="10")
    stage.io.epoch = 0
    stage._pace_refusals([_record("a", 100)] * 4 + [_record("b", 100)], [_shed("a")] * 4)  # noqa: SLF001
    assert not stage.paced and stage.turn_of("a") == 6 and stage.turn_of("b") == 32
    backlog = _numbered("a", 70)
    assert stage._turn(backlog + _numbered("b", 1)) == backlog[:6] + _numbered("b", 1)  # noqa: SLF001
    stage._pace_refusals([_record("a", 100)] * 8, [_shed("a")] * 8)  # noqa: SLF001 - in debt: held, then a record a turn
    assert "a" in stage.paced and stage._turn([]) == []  # noqa: SLF001
    del stage.paced["a"]
    assert stage._turn([]) == backlog[6:7]  # noqa: SLF001


def test_records_deferred_before_a_rebalance_are_left_to_their_next_owner(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_TURN_RECORDS="32")
    stage.io.epoch = 0
    stage._turn(_numbered("a", 50))  # noqa: SLF001
    stage.io.epoch = 1  # the partitions were revoked (and read again from the committed offset)
    assert stage._turn(_numbered("b", 1)) == _numbered("b", 1) and not stage.deferred  # noqa: SLF001
    assert _stage(tmp_path, MMSTREAM_ROUTER_TURN_RECORDS="0").turn_records is None
