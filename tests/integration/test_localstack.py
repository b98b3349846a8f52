"""The local launcher against real processes: a second broker and Redis on spare ports.

Ports stay clear of the defaults (9092/9093/6379), which a developer's own stack may use.
Jars come from the real cache dir, so only the first run on a machine pays for Maven.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmstream.localstack import LocalKafka, LocalRedis, LocalStackError, procs
from schemas.settings import LocalSettings

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
KAFKA_PORT, CONTROLLER_PORT, REDIS_PORT = 19192, 19193, 16479
BOOTSTRAP = f"127.0.0.1:{KAFKA_PORT}"
REDIS_URL = f"redis://127.0.0.1:{REDIS_PORT}/0"


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> LocalSettings:
    return LocalSettings(state_dir=tmp_path_factory.mktemp("state"),
                         kafka_controller_port=CONTROLLER_PORT, kafka_heap_mb=256,
                         redis_maxmemory_mb=32)


@pytest.fixture(scope="module")
def stack(local: LocalSettings):
    for port in (KAFKA_PORT, CONTROLLER_PORT, REDIS_PORT):
        if procs.is_port_open("127.0.0.1", port):
            pytest.skip(f"port {port} is in use by something this test did not start")
    kafka = LocalKafka(local, BOOTSTRAP, REPO_ROOT)
    cache = LocalRedis(local, REDIS_URL, template=REPO_ROOT / "infra" / "redis" / "redis.conf")
    first = (kafka.start(timeout_s=60), cache.start())
    yield kafka, cache, first
    cache.stop()
    kafka.stop(grace_s=20)


def test_start_reports_healthy_servers_of_ours(stack) -> None:
    _, _, (k, r) = stack
    assert k.running and k.healthy and not k.external and k.pid is not None
    assert k.bootstrap == BOOTSTRAP and k.data_dir.is_dir() and k.log_file.is_file()
    assert r.running and r.healthy and not r.external and r.pid is not None
    assert r.maxmemory_policy == "allkeys-lru" and r.maxmemory_bytes == 32 * 1024 * 1024


def test_start_again_reuses_the_same_processes(stack) -> None:
    kafka, cache, (k, r) = stack
    assert kafka.start().pid == k.pid
    assert cache.start().pid == r.pid


def test_another_state_dir_reuses_the_servers_as_external(stack, tmp_path: Path) -> None:
    other = LocalSettings(state_dir=tmp_path, kafka_controller_port=CONTROLLER_PORT + 2)
    k = LocalKafka(other, BOOTSTRAP, REPO_ROOT).start()
    r = LocalRedis(other, REDIS_URL).start()
    assert k.external and k.healthy and k.pid is None
    assert r.external and r.healthy and r.pid is None
    # Stopping through a launcher that did not start them must leave them running.
    assert LocalKafka(other, BOOTSTRAP, REPO_ROOT).stop().running
    assert LocalRedis(other, REDIS_URL).stop().running


async def test_produce_consume_round_trip(stack) -> None:
    topic = f"localstack-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP)
    await producer.start()
    try:
        sent = {f"k{i}".encode(): f"v{i}".encode() for i in range(10)}
        for key, value in sent.items():
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=BOOTSTRAP, group_id=topic,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        got: dict[bytes, bytes] = {}
        while len(got) < len(sent):
            batches = await consumer.getmany(timeout_ms=10_000)
            assert batches, "no records within 10 s"
            for records in batches.values():
                got.update((r.key, r.value) for r in records)
    finally:
        await consumer.stop()
    assert got == sent


def test_redis_round_trip(stack) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.set("localstack:probe", b"x", ex=60)
        assert client.get("localstack:probe") == b"x"
        assert client.config_get("save") == {"save": ""}
    finally:
        client.close()


def test_a_port_held_by_a_stranger_gets_one_clear_error(local: LocalSettings, tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        other = LocalSettings(state_dir=tmp_path, kafka_controller_port=CONTROLLER_PORT + 2)
        with pytest.raises(LocalStackError, match="not a Kafka broker"):
            LocalKafka(other, f"127.0.0.1:{port}", REPO_ROOT, probe_timeout_s=0.5).start()
        with pytest.raises(LocalStackError, match="does not answer Redis PING"):
            LocalRedis(other, f"redis://127.0.0.1:{port}/0", probe_timeout_s=0.5).start()


def test_jars_are_fetched_once_and_a_half_copy_is_redone(tmp_path: Path) -> None:
    # Maven resolves from its local repository here, which the main fixture has filled.
    kafka = LocalKafka(LocalSettings(state_dir=tmp_path, cache_dir=tmp_path), BOOTSTRAP, REPO_ROOT)
    kafka.libs.mkdir(parents=True)
    (kafka.libs / "half-copied.jar").write_bytes(b"")  # an interrupted earlier fetch
    libs = kafka.ensure_jars()
    jars = sorted(p.name for p in libs.iterdir())
    assert "half-copied.jar" not in jars and f"kafka_2.13-{kafka.local.kafka_version}.jar" in jars
    marker = libs.parent / "libs.complete"
    before = marker.stat().st_mtime_ns
    assert kafka.ensure_jars() == libs and marker.stat().st_mtime_ns == before


def test_a_missing_tool_is_one_sentence_not_a_traceback() -> None:
    hint = "Frobnicator is needed to run the test: apt-get install frobnicator"
    with pytest.raises(LocalStackError) as err:
        procs.require_tool("frobnicator-that-does-not-exist", hint)
    assert str(err.value) == hint


def test_stop_then_start_runs_a_fresh_broker(stack) -> None:
    # Last test in the module: it replaces the processes the fixture started.
    kafka, cache, (k, r) = stack
    stopped_k, stopped_r = kafka.stop(grace_s=20), cache.stop()
    assert not stopped_k.running and not stopped_r.running
    assert not procs.is_alive(k.pid) and not procs.is_alive(r.pid)
    for port in (KAFKA_PORT, CONTROLLER_PORT, REDIS_PORT):
        assert not procs.is_port_open("127.0.0.1", port), port
    again = kafka.start(timeout_s=60)
    assert again.healthy and again.pid != k.pid
    assert not k.data_dir.parent.exists(), "the stopped run's directory was not cleaned up"
