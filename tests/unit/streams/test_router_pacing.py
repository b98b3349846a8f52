"""The router on an authenticating broker holds a tenant's ingress topics past its large-record
bytes while another tenant's records come too (``streams.policies.pacing``), and takes them
again when the hold ends, unless one of its gates holds them. The runtime's I/O is a recorder:
what is tested is which topics the stage pauses and resumes."""

from __future__ import annotations

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.settings import Settings
from schemas.topics import TopicNames
from streams.app import create_app
from streams.observe.health import WorkerHealth
from streams.observe.metrics import Metrics
from streams.stages.router import RouterStage

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
    assert reg.get_sample_value("mmstream_tenant_paced_total", {"tenant": "a"}) == 1
    assert abs(reg.get_sample_value("mmstream_tenant_paced_seconds_total", {"tenant": "a"}) - 1.0) < 0.05
    assert reg.get_sample_value("mmstream_tenant_paced_total", {"tenant": "b"}) is None
