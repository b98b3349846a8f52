"""Secure mode against a real secured broker: SASL_SSL, ACLs, tenants from the topic.

One secured broker (its own ports and state dir, never the shared plaintext one) and one
small pipeline (router, assembler, text encoder) logged in as the service principal serve
every test here. Two tenants: ``acme`` made through the CLI (`mmstream tenant add`, which
writes its client properties file) and ``globex`` through ``add_tenant``. What the issue's
"done when" asks, each against the broker's own authorization:

- a tenant's clients (the SDK; aiokafka; librdkafka through confluent-kafka, from the
  properties file as is) get answers;
- another tenant's credentials cannot read them; an unauthenticated client cannot produce;
- a tenant cannot produce to ``<p>.encoded.*`` or any other internal topic;
- a payload ``tenant`` that lies is not believed; a ``reply_to`` outside the tenant's own
  reply namespace is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAuthorizationFailedError

from mmstream import cli, localstack
from mmstream.localstack.secure import SecureKafka
from mmstream.supervisor import Supervisor
from mmstream.tenants import add_tenant, properties_text
from schemas.codec import JSON, unpack
from schemas.events import Event
from schemas.request import Modality, Part, Request
from schemas.settings import LocalSettings, Settings
from streams.sdk.client import Client, new_id
from streams.connection import KafkaSecurity, client_kwargs, parse_properties, read_properties
from schemas.topics import TopicNames
from streams.topics import collection_spec, ensure_topics, topic_specs
from tests.integration.conftest import free_ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@dataclass
class SecureStack:
    broker: SecureKafka
    settings: Settings
    """The pipeline's settings: the service principal."""
    props: dict[str, Path]
    """tenant -> its client properties file."""

    @property
    def bootstrap(self) -> str:
        return self.settings.kafka.bootstrap

    @property
    def names(self) -> TopicNames:
        return TopicNames(self.settings.kafka.topic_prefix)

    def tenant(self, name: str) -> KafkaSecurity:
        return read_properties(self.props[name])[1]


@pytest.fixture(scope="module")
def secure(infra: Settings, tmp_path_factory: pytest.TempPathFactory) -> SecureStack:
    state = tmp_path_factory.mktemp("secure-state")
    port, internal, controller = free_ports(3)
    local = LocalSettings(state_dir=state, kafka_secure_port=port, kafka_secure_internal_port=internal,
                          kafka_secure_controller_port=controller, kafka_heap_mb=256)
    broker = SecureKafka(local, REPO)
    broker.start(timeout_s=120)
    env = {**os.environ, **broker.env(),
           "MMSTREAM_KAFKA_TOPIC_PREFIX": f"s{uuid.uuid4().hex[:10]}", "MMSTREAM_KAFKA_PARTITIONS": "2",
           "MMSTREAM_LOCAL_STATE_DIR": str(state), "MMSTREAM_LOCAL_METRICS_BASE_PORT": "0",
           "MMSTREAM_LOCAL_KAFKA_SECURE_PORT": str(port), "MMSTREAM_ROUTER_TOPIC_CACHE_S": "1"}
    settings = Settings.from_env(env)
    sup = Supervisor(settings, env)
    try:
        asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka), 1, client_kwargs(settings)))
        props = {"acme": state / "acme.properties", "globex": state / "globex.properties"}
        # acme through the command line, as a person would; globex through the function.
        old = dict(os.environ)
        os.environ.update({k: v for k, v in env.items() if k.startswith("MMSTREAM_")})
        try:
            assert cli.main(["tenant", "add", "acme", "--out", str(props["acme"])]) == 0
        finally:
            os.environ.clear()
            os.environ.update(old)
        globex = asyncio.run(add_tenant(settings, "globex", ["rt"]))
        props["globex"].write_text(properties_text(globex, settings.kafka.topic_prefix))
        sup.start({"router": 1, "assembler": 1, "encode.text": 1})
        stack = SecureStack(broker, settings, props)
        asyncio.run(_wait_serving(stack))
    except BaseException:
        logs = "\n".join(f"--- {w.log_file}\n" + Path(w.log_file).read_text()[-3000:] for w in sup.workers())
        sup.stop()
        broker.stop(grace_s=20)
        raise RuntimeError(f"the secure stack did not come up\n{logs}")
    yield stack
    sup.stop()
    broker.stop(grace_s=20)


async def _wait_serving(stack: SecureStack, timeout_s: float = 180.0) -> None:
    """Until a tenant's request is answered (the router found the tenants' topics)."""
    deadline = time.monotonic() + timeout_s
    async with Client.from_properties(stack.props["acme"], stack.names.prefix) as client:
        while time.monotonic() < deadline:
            sub = await client.submit(Request(id=f"probe-{new_id()}", parts=(Part(Modality.TEXT, text="probe"),),
                                              deadline_ms=10_000))
            try:
                if (await sub.result(timeout_s=15)).kind == "result":
                    return
            except asyncio.TimeoutError:
                client.forget(sub.id)
    raise TimeoutError("no tenant request was answered")


def _aiokafka(stack: SecureStack, who: KafkaSecurity | None) -> dict:
    return {"bootstrap_servers": stack.bootstrap, **(who.aiokafka_kwargs() if who else {})}


async def _produce(stack: SecureStack, who: KafkaSecurity | None, topic: str, value: bytes,
                   key: bytes | None = None, headers: list | None = None) -> None:
    producer = AIOKafkaProducer(request_timeout_ms=10_000, **_aiokafka(stack, who))
    await asyncio.wait_for(producer.start(), 20)
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, value, key=key, headers=headers), 20)
    finally:
        await producer.stop()


async def _events_of(stack: SecureStack, who: KafkaSecurity, topic: str, rid: str, since_ms: float,
                     timeout_s: float = 30.0) -> list[Event]:
    """Events of ``rid`` on ``topic`` read as ``who`` until a terminal one (or the timeout)."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **_aiokafka(stack, who))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(stack.settings.kafka.partitions)]
        consumer.assign(tps)
        starts = await consumer.offsets_for_times({tp: int(since_ms) for tp in tps})
        for tp in tps:
            if starts.get(tp) is not None:
                consumer.seek(tp, starts[tp].offset)
            else:
                await consumer.seek_to_end(tp)
        found: list[Event] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    if r.key == rid.encode():
                        found.append(Event.from_wire(unpack(r.value)))
            if any(e.terminal for e in found):
                break
        return found
    finally:
        await consumer.stop()


# -- a tenant gets answers -----------------------------------------------------------------

def test_the_properties_file_has_the_standard_keys(secure):
    props = parse_properties(secure.props["acme"].read_text())
    assert props["bootstrap.servers"] == secure.bootstrap and props["security.protocol"] == "SASL_SSL"
    assert props["sasl.mechanism"] == "SCRAM-SHA-512" and props["sasl.username"] == "acme"
    assert props["sasl.password"] and Path(props["ssl.ca.location"]).is_file()
    assert secure.props["acme"].stat().st_mode & 0o077 == 0  # it holds a password
    assert f"{secure.names.prefix}.ingress.rt.acme" in secure.props["acme"].read_text()


async def test_a_tenant_sdk_client_gets_answers_as_itself(secure):
    async with Client.from_properties(secure.props["acme"], secure.names.prefix) as client:
        assert client.reply_to == secure.names.tenant_results("acme")
        sub = await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="hello from acme"),)))
        event = await sub.result(timeout_s=60)
    assert event.kind == "result", event.error


async def test_a_plain_aiokafka_client_from_the_properties_file_gets_answers(secure):
    bootstrap, acme = read_properties(secure.props["acme"])
    rid, since = new_id(), time.time() * 1000 - 1000
    body = {"v": 1, "id": rid, "task": "embed", "parts": [{"modality": "text", "text": "json, no tenant field"}]}
    await _produce(secure, acme, secure.names.tenant_ingress("rt", "acme"), json.dumps(body).encode(), rid.encode(),
                   [("content-type", JSON.encode())])
    events = await _events_of(secure, acme, secure.names.tenant_results("acme"), rid, since)
    assert events and events[-1].kind == "result", events


def test_a_librdkafka_client_with_the_properties_file_as_is_gets_answers(secure):
    ck = pytest.importorskip("confluent_kafka")
    conf = parse_properties(secure.props["acme"].read_text())  # the file, every key as written
    rid = new_id()
    consumer = ck.Consumer({**conf, "group.id": f"acme.{rid}", "auto.offset.reset": "latest",
                            "enable.auto.commit": False})
    consumer.assign([ck.TopicPartition(secure.names.tenant_results("acme"), p, ck.OFFSET_END)
                     for p in range(secure.settings.kafka.partitions)])
    try:
        deadline = time.monotonic() + 20
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.2)
        consumer.poll(1.0)  # positions resolved before the request goes out
        producer = ck.Producer(conf)
        body = {"v": 1, "id": rid, "task": "embed", "parts": [{"modality": "text", "text": "from librdkafka"}]}
        producer.produce(secure.names.tenant_ingress("rt", "acme"), json.dumps(body).encode(), rid.encode(),
                         headers=[("content-type", JSON.encode())])
        assert producer.flush(20) == 0
        terminal = None
        deadline = time.monotonic() + 60
        while terminal is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() or msg.key() != rid.encode():
                continue
            event = Event.from_wire(unpack(msg.value()))
            terminal = event if event.terminal else None
    finally:
        consumer.close()
    assert terminal is not None and terminal.kind == "result", terminal


# -- what a tenant may not do ----------------------------------------------------------------

async def _read_from_start(secure: SecureStack, who: KafkaSecurity, topic: str) -> tuple[list, bool]:
    """(records of ``topic``'s partitions read from offset 0 for a few seconds, whether the
    broker refused) as ``who``; a topic ``who`` may not describe is not even in its metadata."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **_aiokafka(secure, who))
    await consumer.start()
    records: list = []
    try:
        await consumer._client.force_metadata_update()
        visible = consumer.partitions_for_topic(topic)
        if not visible:  # the broker does not even say it exists
            return records, True
        tps = [TopicPartition(topic, p) for p in range(secure.settings.kafka.partitions)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(batch)
    except TopicAuthorizationFailedError:
        return records, True
    finally:
        await consumer.stop()
    return records, False


async def test_another_tenants_credentials_cannot_read_the_answers(secure):
    topic = secure.names.tenant_results("acme")
    async with Client.from_properties(secure.props["acme"], secure.names.prefix) as client:
        sub = await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="for acme's eyes only"),)))
        assert (await sub.result(timeout_s=60)).kind == "result"
    mine, refused = await _read_from_start(secure, secure.tenant("acme"), topic)
    assert mine and not refused  # the answers are there, and acme reads them
    theirs, refused = await _read_from_start(secure, secure.tenant("globex"), topic)
    assert theirs == [] and refused
    with pytest.raises(TopicAuthorizationFailedError):  # nor send as acme
        await _produce(secure, secure.tenant("globex"), secure.names.tenant_ingress("rt", "acme"), b"{}")


async def test_an_unauthenticated_client_cannot_produce(secure):
    ingress = secure.names.tenant_ingress("rt", "acme")
    with pytest.raises((KafkaConnectionError, asyncio.TimeoutError)):  # plaintext to a TLS port
        await _produce(secure, None, ingress, b"{}")
    ca = str(secure.broker.ca_file)
    for who in (KafkaSecurity("SSL", ca_file=ca),  # TLS without logging in
                KafkaSecurity("SASL_SSL", "SCRAM-SHA-512", "acme", "not-the-password", ca_file=ca),
                KafkaSecurity("SASL_SSL", "SCRAM-SHA-512", "nobody", "x", ca_file=ca)):
        with pytest.raises((KafkaConnectionError, KafkaError, asyncio.TimeoutError)):
            await _produce(secure, who, ingress, b"{}")
    # The loopback inter-broker listener wants the broker's own certificate.
    internal = f"127.0.0.1:{secure.broker.internal_port}"
    producer = AIOKafkaProducer(bootstrap_servers=internal, request_timeout_ms=5000,
                                **KafkaSecurity("SSL", ca_file=ca).aiokafka_kwargs())
    with pytest.raises((KafkaConnectionError, KafkaError, asyncio.TimeoutError)):
        try:
            await asyncio.wait_for(producer.start(), 20)
            await asyncio.wait_for(producer.send_and_wait(ingress, b"{}"), 20)
        finally:
            await producer.stop()


async def test_a_tenant_writes_its_own_collections_and_no_internal_topic(secure):
    acme, n = secure.tenant("acme"), secure.names
    internal = [n.encoded("rt"), n.encoded("bulk"), n.encode("text", "rt"), n.generate("rt"), n.ingress("rt"),
                n.results, n.dlq, n.assembler_done, n.tenant_results("acme"), n.tenant_ingress("rt", "globex"),
                n.vectors, n.retrieve("rt"), n.retrieve_done, n.docs("globex", "kb")]
    k = secure.settings.kafka
    await ensure_topics(k.bootstrap, [collection_spec(k, t, "kb") for t in ("acme", "globex")], 1,
                        client_kwargs(secure.settings))
    await _produce(secure, acme, n.docs("acme", "kb"), b'{"text": "its own collection"}', key=b"d1")
    for topic in internal:
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(secure, acme, topic, b"forged")
    admin = AIOKafkaAdminClient(bootstrap_servers=secure.bootstrap, **acme.aiokafka_kwargs())
    await admin.start()
    try:  # nor make topics of its own
        response = await admin.create_topics([NewTopic(n.tenant_results("acme") + ".mine", 1, 1)])
        assert any(code for _, code, *_ in response.topic_errors)
    except KafkaError:
        pass
    finally:
        await admin.close()


async def test_a_tenant_cannot_read_internal_topics(secure):
    n = secure.names
    service, _ = await _read_from_start(secure, KafkaSecurity.from_settings(secure.settings.kafka), n.encoded("rt"))
    assert service  # there is something to see: the pipeline's own records
    for topic in (n.encoded("rt"), n.encode("text", "rt"), n.ingress("rt"), n.results, n.dlq):
        records, refused = await _read_from_start(secure, secure.tenant("acme"), topic)
        assert records == [] and refused, topic


# -- the tenant is the topic's ---------------------------------------------------------------

async def _ask(secure: SecureStack, tenant: str, body: dict) -> list[Event]:
    who = secure.tenant(tenant)
    rid, since = body["id"], time.time() * 1000 - 1000
    await _produce(secure, who, secure.names.tenant_ingress("rt", tenant), json.dumps(body).encode(), rid.encode(),
                   [("content-type", JSON.encode())])
    return await _events_of(secure, who, secure.names.tenant_results(tenant), rid, since)


async def test_a_payload_tenant_that_lies_is_not_believed(secure):
    body = {"v": 1, "id": new_id(), "tenant": "globex", "task": "embed",
            "parts": [{"modality": "text", "text": "I am globex, honest"}]}
    events = await _ask(secure, "acme", body)
    assert events and events[-1].kind == "error", events
    assert events[-1].error["code"] == "invalid_request" and events[-1].error.get("field") == "tenant"


async def test_a_reply_to_outside_the_tenants_namespace_is_refused(secure):
    n = secure.names
    for target in (n.tenant_results("globex"), n.encoded("rt"), n.ingress("rt"), n.results):
        body = {"v": 1, "id": new_id(), "task": "embed", "reply_to": target,
                "parts": [{"modality": "text", "text": f"answer me on {target}"}]}
        events = await _ask(secure, "acme", body)  # answered on acme's own reply topic
        assert events and events[-1].kind == "error", (target, events)
        assert events[-1].error["code"] == "invalid_request" and events[-1].error.get("field") == "reply_to"


# -- the command line ------------------------------------------------------------------------

def test_up_secure_reuses_the_secure_broker_and_status_sees_it(secure, monkeypatch, capsys):
    local = secure.broker.local
    (redis_port,) = free_ports(1)
    monkeypatch.setenv("MMSTREAM_LOCAL_REDIS_SECURE_PORT", str(redis_port))
    try:
        _up_secure_infra(secure, monkeypatch, capsys, local)
    finally:  # the secured Redis `up --secure` started (the broker is the fixture's)
        localstack.secure_redis(Settings.from_env(), REPO).stop()


def _up_secure_infra(secure, monkeypatch, capsys, local) -> None:
    for var, value in {"MMSTREAM_LOCAL_STATE_DIR": str(local.state_dir),
                       "MMSTREAM_LOCAL_KAFKA_SECURE_PORT": str(local.kafka_secure_port),
                       "MMSTREAM_LOCAL_KAFKA_SECURE_INTERNAL_PORT": str(local.kafka_secure_internal_port),
                       "MMSTREAM_LOCAL_KAFKA_SECURE_CONTROLLER_PORT": str(local.kafka_secure_controller_port),
                       "MMSTREAM_KAFKA_TOPIC_PREFIX": secure.names.prefix}.items():
        monkeypatch.setenv(var, value)
    assert cli.main(["up", "--secure", "--infra-only"]) == 0
    out = capsys.readouterr().out
    env_file = local.state_dir / "kafka-secure" / "mmstream.env"
    assert f"kafka  {secure.bootstrap}  pid={secure.broker.status().pid}" in out and str(env_file) in out
    assert env_file.stat().st_mode & 0o077 == 0
    shell = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert shell["MMSTREAM_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and shell["MMSTREAM_KAFKA_BOOTSTRAP"] == secure.bootstrap
    for var, value in shell.items():  # a shell that sourced the file
        monkeypatch.setenv(var, value)
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"kafka   {secure.bootstrap}" in out and "healthy" in out.splitlines()[0]
    assert cli.main(["config"]) == 0
    assert shell["MMSTREAM_KAFKA_PASSWORD"] not in capsys.readouterr().out
    assert "mmworker:" in shell["MMSTREAM_REDIS_URL"]  # the workers' user of the secured Redis it started


def test_tenant_add_sets_the_tenants_produce_quota_on_the_broker(secure):
    from aiokafka.admin import AIOKafkaAdminClient

    from mmstream.kafka_admin import user_quotas

    async def quotas(user: str) -> dict[str, float]:
        admin = AIOKafkaAdminClient(bootstrap_servers=secure.bootstrap, **client_kwargs(secure.settings))
        await admin.start()
        try:
            return await user_quotas(admin, user)
        finally:
            await admin.close()

    expected = secure.settings.quota.produce_bytes_per_s
    assert asyncio.run(quotas("acme")) == {"producer_byte_rate": expected}  # by `tenant add` on the CLI
    assert asyncio.run(quotas("globex")) == {"producer_byte_rate": expected}  # by add_tenant
