"""Kafka client security: one description turned into aiokafka options, librdkafka
properties and Faust credentials; every client of the code takes its options from it; the
SDK as a tenant uses its own topics. No broker involved."""

from __future__ import annotations

import ast
import asyncio
import ssl
import subprocess
from pathlib import Path

import pytest

from schemas.codec import pack, unpack
from schemas.request import Modality, Part, Request
from schemas.settings import Settings, SettingsError, describe
from streams.sdk.client import Client, ClientError
from streams.connection import (FileTokenProvider, KafkaSecurity, SecurityConfigError, client_kwargs,
                              format_properties, parse_properties, read_properties)

REPO = Path(__file__).resolve().parents[3]
SASL = {"MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "MMSTREAM_KAFKA_USERNAME": "svc",
        "MMSTREAM_KAFKA_PASSWORD": "s3cret-pw"}


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory) -> str:
    """A throwaway self-signed CA (what a TLS context loads)."""
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "1", "-subj", "/CN=t"],
                   check=True, capture_output=True)
    return str(d / "ca.pem")


def test_plaintext_clients_get_no_extra_options():
    assert client_kwargs(Settings()) == {}
    assert KafkaSecurity().properties("h:1") == {"bootstrap.servers": "h:1", "security.protocol": "PLAINTEXT"}


def test_sasl_ssl_options_carry_the_credentials_and_a_context_trusting_the_ca(ca_file):
    kw = client_kwargs(Settings.from_env({**SASL, "MMSTREAM_KAFKA_SSL_CA_FILE": ca_file}))
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["sasl_plain_username"] == "svc" and kw["sasl_plain_password"] == "s3cret-pw"
    ctx = kw["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert any(c["subject"] == ((("commonName", "t"),),) for c in ctx.get_ca_certs())


def test_oauthbearer_reads_its_token_from_a_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc.def\n")
    kw = KafkaSecurity("SASL_PLAINTEXT", "OAUTHBEARER", oauth_token_file=str(token)).aiokafka_kwargs()
    provider = kw["sasl_oauth_token_provider"]
    assert isinstance(provider, FileTokenProvider) and asyncio.run(provider.token()) == "abc.def"
    token.write_text("rotated")
    assert asyncio.run(provider.token()) == "rotated"


@pytest.mark.parametrize("env, says", [
    ({"MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "needs username and password"),
    ({**SASL, "MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "MMSTREAM_KAFKA_SASL_MECHANISM": "PLAIN"},
     "in clear"),
    ({**SASL, "MMSTREAM_KAFKA_SASL_MECHANISM": "OAUTHBEARER"}, "oauth_token_file"),
    ({"MMSTREAM_KAFKA_SSL_CERT_FILE": "/c.pem"}, "go together"),
    ({"MMSTREAM_KAFKA_SECURITY_PROTOCOL": "TLS"}, "SASL_SSL"),
    ({**SASL, "MMSTREAM_KAFKA_SASL_MECHANISM": "GSSAPI"}, "SCRAM-SHA-512"),
])
def test_incomplete_security_settings_are_refused_at_start(env, says):
    with pytest.raises(SettingsError, match=says):
        Settings.from_env(env)


def test_the_password_is_never_printed():
    s = Settings.from_env(SASL)
    assert "s3cret-pw" not in repr(s) and "s3cret-pw" not in str(describe(s))
    assert dict((v, x) for v, x, _ in describe(s))["MMSTREAM_KAFKA_PASSWORD"] != "s3cret-pw"
    assert "s3cret-pw" not in repr(KafkaSecurity.from_settings(s.kafka))


def test_properties_round_trip_with_the_standard_keys(tmp_path):
    sec = KafkaSecurity("SASL_SSL", "SCRAM-SHA-256", "acme", "p=w:1", ca_file="/etc/ca.pem")
    props = sec.properties("a:1,b:2")
    assert props == {"bootstrap.servers": "a:1,b:2", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
                     "sasl.username": "acme", "sasl.password": "p=w:1", "ssl.ca.location": "/etc/ca.pem"}
    path = tmp_path / "acme.properties"
    path.write_text(format_properties(props, "a comment\nsend to: mm.ingress.rt.acme"))
    assert read_properties(path) == ("a:1,b:2", sec)
    assert path.read_text().startswith("# a comment\n# send to: mm.ingress.rt.acme\n")


def test_bad_properties_files_are_named():
    with pytest.raises(SecurityConfigError, match="key=value"):
        parse_properties("just words")
    with pytest.raises(SecurityConfigError, match="security protocol"):
        KafkaSecurity.from_properties({"security.protocol": "carrier-pigeon"})


def test_every_kafka_client_in_the_code_takes_security_options():
    """aiokafka clients are built only with ``**`` options (client_kwargs or a KafkaSecurity's):
    a client built without them would connect in plaintext to a secured broker."""
    missing = []
    for root in ("streams", "mmstream"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                        "AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"):
                    if not any(k.arg is None for k in node.keywords):
                        missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert missing == []


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    async def start(self, reply_to: str) -> None:
        self.reply_to = reply_to

    async def send(self, topic, key, value, headers) -> None:
        self.sent.append((topic, unpack(value)))

    async def records(self):
        await asyncio.Event().wait()
        yield None, b""

    async def close(self) -> None:
        pass


def test_a_tenant_client_sends_on_its_own_topics_as_itself():
    async def go():
        transport = Recorder()
        async with Client("h:1", "mm", tenant="acme", transport=transport) as client:
            await client.submit(Request(id="r1", parts=(Part(Modality.TEXT, text="x"),)))
            await client.submit_raw("r2", pack({"id": "r2"}), "application/msgpack", lane="bulk")
        return transport

    transport = asyncio.run(go())
    assert transport.reply_to == "mm.results.acme"
    (topic1, wire1), (topic2, _) = transport.sent
    assert topic1 == "mm.ingress.rt.acme" and topic2 == "mm.ingress.bulk.acme"
    assert wire1["tenant"] == "acme" and wire1["reply_to"] == "mm.results.acme"


def test_a_client_from_a_properties_file_is_its_user(tmp_path):
    path = tmp_path / "acme.properties"
    path.write_text(format_properties(KafkaSecurity("SASL_SSL", username="acme", password="pw").properties("h:9")))
    client = Client.from_properties(path, "mm", transport=Recorder())
    assert client.tenant == "acme" and client.bootstrap == "h:9" and client.reply_to == "mm.results.acme"
    with pytest.raises(ClientError, match="tenant name"):
        Client("h:1", "mm", tenant="Not.A.Tenant", transport=Recorder())


def test_faust_gets_its_credentials_from_the_same_description(ca_file):
    from faust.auth import SASLCredentials

    from streams.app import faust_credentials

    assert faust_credentials(KafkaSecurity()) is None
    creds = faust_credentials(KafkaSecurity.from_settings(Settings.from_env({**SASL, "MMSTREAM_KAFKA_SSL_CA_FILE": ca_file}).kafka))
    assert isinstance(creds, SASLCredentials)
    assert (creds.username, creds.password, creds.mechanism.value) == ("svc", "s3cret-pw", "SCRAM-SHA-512")
