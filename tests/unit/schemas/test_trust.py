"""Hostile bytes and names at the bottom layer: decoding never raises anything but
``DecodeError``, nesting is bounded, tenant names cannot break out of their namespace."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.codec import MAX_DEPTH, DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodedPart, EncodeJob, Manifest, Verdict, fan_in_from_wire, request_key
from schemas.request import TENANT_RE, Limits, claim_key, claim_prefix, validate_request
from schemas.settings import Settings, SettingsError, parse_quota_overrides, redact


@pytest.mark.parametrize("raw", [
    b"\x81\x91\x00\x00",  # a map keyed by a list: TypeError (unhashable) inside msgpack
    b"\x81\x81\x00\x00\x00",  # keyed by a map
    b"\x91" * 100_000 + b"\x00",  # deeper than msgpack's own stack
    b"\xc7\x0c\xff" + b"\xff" * 12,  # a timestamp extension that does not decode
    b"\xa2\xff\xfe",  # a string that is no UTF-8
    b"\xdd\xff\xff\xff\xff",  # a list that says it holds 4 billion items
    b"[" * 100_000 + b"]" * 100_000,  # JSON deeper than the parser's recursion
])
def test_hostile_bytes_are_a_decode_error_and_nothing_else(raw):
    with pytest.raises(DecodeError):
        unpack(raw)


def nested(depth: int) -> dict:
    obj: dict = {"leaf": 1}
    for _ in range(depth - 1):
        obj = {"x": obj}
    return obj


@pytest.mark.parametrize("encode", [lambda o: msgpack.packb(o), lambda o: json.dumps(o).encode()])
def test_nesting_is_bounded_below_any_stack(encode):
    assert unpack(encode(nested(MAX_DEPTH)))  # as deep as allowed
    with pytest.raises(DecodeError, match="nested"):
        unpack(encode(nested(MAX_DEPTH + 1)))
    deep_list: list = [1]
    for _ in range(MAX_DEPTH):
        deep_list = [deep_list]
    with pytest.raises(DecodeError, match="nested"):  # lists count as much as maps
        unpack(encode({"parts": deep_list}))


@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_map_or_a_decode_error(raw):
    try:
        assert isinstance(unpack(raw), dict)
    except DecodeError:
        pass


@pytest.mark.parametrize("tenant", ["a:b", "a/b", "a|b", "..", ".", "-x", "_x", "a b", "a\nb", "ténant"])
def test_a_tenant_that_could_leave_its_namespace_is_invalid(tenant):
    with pytest.raises(WireError) as e:
        validate_request({"id": "r1", "tenant": tenant, "parts": [{"modality": "text", "text": "x"}]}, Limits())
    assert e.value.code == ErrorCode.INVALID_REQUEST and e.value.field == "tenant"


def test_ids_and_tenants_are_matched_whole():
    """`$` lets a trailing newline through; both use fullmatch."""
    assert not TENANT_RE.fullmatch("acme\n")
    with pytest.raises(WireError) as e:
        validate_request({"id": "r1\n", "parts": [{"modality": "text", "text": "x"}]}, Limits())
    assert e.value.field == "id"
    ok = validate_request({"id": "r1", "tenant": "acme.prod_1-x", "parts": [{"modality": "text", "text": "x"}]},
                          Limits())
    assert ok.tenant == "acme.prod_1-x"


def test_namespaced_keys_cannot_collide_across_tenants():
    assert request_key("acme", "r:1") == "acme/r:1"
    assert claim_key("acme", "r1", 2) == "mm:claim:acme:r1:2"
    # No tenant's claim prefix is inside another's: tenant names hold no ':'.
    assert not claim_key("acme", "x", 0).startswith(claim_prefix("acm"))
    assert not claim_prefix("a").startswith(claim_prefix("a-b")) and not claim_prefix("a-b").startswith(claim_prefix("a"))


def test_new_fields_are_optional_and_old_maps_still_decode():
    job = EncodeJob(id="r", part=0, n_parts=1, modality="text", lane="rt", tenant="t", deadline_at_ms=1.0,
                    sent_at_ms=0.0, text="x")
    assert "nonce" not in job.to_wire()
    assert EncodeJob.from_wire({**job.to_wire(), "nonce": "n1"}).nonce == "n1"
    part = EncodedPart(id="r", part=0, modality="text", sent_at_ms=1.0, tenant="t", nonce="n1")
    assert fan_in_from_wire(part.to_wire()) == part
    old = {k: v for k, v in part.to_wire().items() if k not in ("tenant", "nonce")}
    assert fan_in_from_wire(old).tenant is None
    m = Manifest(id="r", task="embed", tenant="t", lane="rt", reply_to="mm.results", n_parts=1, modalities=["text"],
                 deadline_at_ms=1.0, accepted_at_ms=0.0, client_sent_at_ms=0.0, sent_at_ms=0.0, nonce="n", digest="d")
    assert fan_in_from_wire(m.to_wire()) == m
    v = Verdict(id="r", tenant="t", lane="rt", reply_to="mm.results", events=[], sent_at_ms=0.0, digest="d")
    assert fan_in_from_wire(v.to_wire()) == v


def test_passwords_are_masked_in_the_url_and_in_its_query():
    assert redact("redis://u:p@h:1/0?password=zz&x=1") == "redis://u:***@h:1/0?password=***&x=1"
    assert redact("rediss://:secret@h") == "rediss://:***@h"


def test_quota_overrides_parse_or_name_the_bad_item():
    assert parse_quota_overrides("acme=50, batchco=5:20") == {"acme": (50.0, 0.0), "batchco": (5.0, 20.0)}
    for bad in ("acme", "acme=x", "=5", "acme=-1"):
        with pytest.raises(ValueError):
            parse_quota_overrides(bad)
    with pytest.raises(SettingsError, match="MMSTREAM_QUOTA_OVERRIDES"):
        Settings.from_env({"MMSTREAM_QUOTA_OVERRIDES": "acme=fast"})


def test_the_clients_redis_url_defaults_to_the_workers():
    s = Settings.from_env({"MMSTREAM_REDIS_URL": "redis://w:p@h:1/0"})
    assert s.redis.clients == "redis://w:p@h:1/0"
    s = Settings.from_env({"MMSTREAM_REDIS_URL": "redis://w:p@h:1/0", "MMSTREAM_REDIS_CLIENT_URL": "redis://c:q@h:1/0"})
    assert s.redis.clients == "redis://c:q@h:1/0"
    assert Settings().assembler.orphan_ttl_ms <= 10_000  # seconds, not minutes
