"""What a tenant is granted, and the admin requests that grant it (no broker: the ACL plan
and the wire encoding; tests/integration/test_secure.py checks them against a real one)."""

from __future__ import annotations

import hashlib
from io import BytesIO

import pytest

from mmstream.kafka_admin import AclBinding, AlterScram, CreateAcls, scram_upsertion
from mmstream.tenants import TenantError, check_name, parse_lanes, tenant_acls
from schemas.settings import Settings

SETTINGS = Settings.from_env({"MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "MMSTREAM_KAFKA_USERNAME": "mmstream",
                              "MMSTREAM_KAFKA_PASSWORD": "pw"})


def grants(acls: list[AclBinding]) -> set[tuple[str, str, str, str]]:
    return {(a.resource, a.name, a.pattern, a.operation) for a in acls if a.allow}


def test_a_tenant_may_write_its_ingress_and_read_its_replies_and_nothing_else():
    acls = tenant_acls("mm", "acme", ("rt", "bulk"))
    assert {a.principal for a in acls} == {"User:acme"} and all(a.allow and a.host == "*" for a in acls)
    assert grants(acls) == {
        ("topic", "mm.ingress.rt.acme", "literal", "write"),
        ("topic", "mm.ingress.bulk.acme", "literal", "write"),
        ("topic", "mm.results.acme", "literal", "read"),
        ("topic", "mm.results.acme.", "prefixed", "read"),  # the dot: never acme2's topics
        ("group", "acme.", "prefixed", "read"),
        ("topic", "mm.docs.acme.", "prefixed", "write"),  # its collections; the dot: never acme2's
    }
    assert grants(tenant_acls("mm", "acme", ("rt",))) == grants(acls) - {("topic", "mm.ingress.bulk.acme", "literal",
                                                                           "write")}


def test_prefixed_grants_never_reach_another_tenant_or_an_internal_topic():
    others = ["mm.results.acme2", "mm.results", "mm.encoded.rt", "mm.ingress.rt.acme2", "mm.ingress.rt",
              "mm.docs.acme2.c", "mm.vectors", "mm.retrieve.rt"]
    for a in tenant_acls("mm", "acme", ("rt", "bulk")):
        if a.resource == "topic":
            matches = [t for t in others if (t.startswith(a.name) if a.pattern == "prefixed" else t == a.name)]
            assert matches == [], (a, matches)


@pytest.mark.parametrize("name", ["mmstream", "mmstream-broker", "Acme", "a.b", "", "x" * 49, "default", "other",
                                  "mmadmin"])
def test_reserved_and_malformed_tenant_names_are_refused(name):
    with pytest.raises(TenantError):
        check_name(name, SETTINGS)


def test_lanes_are_checked():
    assert parse_lanes(None) == ("rt", "bulk") and parse_lanes(["bulk,rt", "rt"]) == ("bulk", "rt")
    with pytest.raises(TenantError, match="express"):
        parse_lanes(["express"])


def test_the_scram_credential_is_the_salted_password_never_the_password():
    name, mechanism, iterations, salt, salted, _ = scram_upsertion("acme", "pencil", "SCRAM-SHA-512", 4096, b"s" * 16)
    assert (name, mechanism, iterations) == ("acme", 2, 4096)
    assert salted == hashlib.pbkdf2_hmac("sha512", b"pencil", b"s" * 16, 4096) and b"pencil" not in salted
    assert scram_upsertion("a", "p", "SCRAM-SHA-256")[1] == 1 and len(scram_upsertion("a", "p")[3]) == 32


def test_the_admin_requests_encode_as_the_protocol_says():
    versions = {30: (1, 3), 51: (0, 0)}
    acl = CreateAcls([AclBinding("topic", "mm.results.acme.", "prefixed", "User:acme", "read")]).prepare(versions)
    assert acl.API_VERSION == 1 and tuple(type(acl).SCHEMA.decode(BytesIO(acl.encode()))) == \
        ([(2, "mm.results.acme.", 4, "User:acme", "*", 3, 3)],)
    scram = AlterScram([scram_upsertion("acme", "pw", salt=b"x" * 4, iterations=4096)]).prepare(versions)
    assert scram.FLEXIBLE_VERSION and scram.API_VERSION == 0
    decoded = type(scram).SCHEMA.decode(BytesIO(scram.encode()))
    assert decoded[0] == [] and decoded[1][0][:4] == ("acme", 2, 4096, b"x" * 4)


def test_a_properties_file_is_private_even_where_one_existed_open(tmp_path):
    import os

    from mmstream.commands import write_properties

    out = tmp_path / "acme.properties"
    out.write_text("old")
    os.chmod(out, 0o644)
    write_properties(out, "sasl.password=secret\n")
    assert out.stat().st_mode & 0o777 == 0o600 and out.read_text() == "sasl.password=secret\n"


def test_the_tenants_redis_user_rides_in_a_comment_librdkafka_skips_and_the_sdk_reads(tmp_path):
    from mmstream.tenants import Tenant, properties_text
    from streams.sdk.client import Client
    from streams.connection import KafkaSecurity, parse_properties, read_redis_url

    sec = KafkaSecurity(protocol="SASL_SSL", mechanism="SCRAM-SHA-512", username="acme", password="pw")
    tenant = Tenant("acme", ("rt",), "127.0.0.1:9094", sec)
    url = "redis://acme:s3cr%2Ft@127.0.0.1:6380/0"
    path = tmp_path / "acme.properties"
    path.write_text(properties_text(tenant, "mm", url))
    assert not any(k.startswith("mmstream") for k in parse_properties(path.read_text()))  # no unknown key
    assert read_redis_url(path) == url
    assert Client.from_properties(path, redis_url="redis://elsewhere:1/0").redis_url == url  # the file's wins
    path.write_text(properties_text(tenant, "mm"))
    assert read_redis_url(path) is None
    assert Client.from_properties(path, redis_url="redis://elsewhere:1/0").redis_url == "redis://elsewhere:1/0"


def test_a_tenants_broker_quotas_come_from_the_settings_and_encode_as_the_protocol_says():
    from mmstream.kafka_admin import AlterQuotas, DescribeQuotas
    from mmstream.tenants import broker_quotas

    assert broker_quotas(SETTINGS) == {"producer_byte_rate": 8 * 1024 * 1024, "consumer_byte_rate": 0,
                                       "request_percentage": 0}
    both = Settings.from_env({"MMSTREAM_QUOTA_PRODUCE_BYTES_PER_S": "0", "MMSTREAM_QUOTA_FETCH_BYTES_PER_S": "100",
                              "MMSTREAM_QUOTA_REQUEST_PERCENTAGE": "25"})
    assert broker_quotas(both) == {"producer_byte_rate": 0, "consumer_byte_rate": 100.0, "request_percentage": 25.0}
    alter = AlterQuotas("acme", {"producer_byte_rate": 5.0, "consumer_byte_rate": 0}).prepare({49: (0, 1)})
    assert alter.API_VERSION == 0 and tuple(type(alter).SCHEMA.decode(BytesIO(alter.encode()))) == \
        ([([("user", "acme")], [("consumer_byte_rate", 0.0, True), ("producer_byte_rate", 5.0, False)])], False)
    describe = DescribeQuotas("acme").prepare({48: (0, 1)})
    assert tuple(type(describe).SCHEMA.decode(BytesIO(describe.encode()))) == ([("user", 0, "acme")], True)
