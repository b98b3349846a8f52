"""Claim checks resolve only inside the requesting tenant's namespace, and no refusal tells
one key (or file) from another."""

from __future__ import annotations

import pytest

from schemas.errors import ErrorCode, WireError
from workers.claims import ClaimResolver


class FakeRedis:
    def __init__(self, values):
        self.values = values
        self.asked: list[str] = []

    def getrange(self, key, start, end):
        self.asked.append(key)
        return self.values.get(key, b"")[start:end + 1]


def resolver(values=None, root=None, max_bytes=100):
    r = ClaimResolver("redis://unused", root, max_bytes)
    r._redis = FakeRedis(values or {})
    return r


def refusal(fn) -> WireError:
    with pytest.raises(WireError) as e:
        fn()
    return e.value


def test_a_tenant_reads_its_own_claim_checks_only():
    values = {"mm:claim:acme:r1:0": b"acme-bytes", "mm:claim:other:r1:0": b"other-secret", "mm:enc:v1|x": b"cached"}
    r = resolver(values)
    assert r.fetch("redis:mm:claim:acme:r1:0", "parts.0.ref", "acme") == b"acme-bytes"
    foreign = refusal(lambda: r.fetch("redis:mm:claim:other:r1:0", "parts.0.ref", "acme"))
    cache = refusal(lambda: r.fetch("redis:mm:enc:v1|x", "parts.0.ref", "acme"))
    missing = refusal(lambda: r.fetch("redis:mm:claim:acme:nope:0", "parts.0.ref", "acme"))
    prefix_only = refusal(lambda: r.fetch("redis:mm:claim:acme:", "parts.0.ref", "acme"))
    # The same answer whether the key is another tenant's, not a claim check, or absent.
    assert {(e.code, e.message, e.field) for e in (foreign, cache, missing, prefix_only)} == {
        (ErrorCode.INVALID_REQUEST, foreign.message, "parts.0.ref")}
    assert "other" not in foreign.message and "secret" not in foreign.message
    assert r._redis.asked == ["mm:claim:acme:r1:0", "mm:claim:acme:nope:0"]  # foreign keys are never read


def test_a_tenant_name_cannot_widen_the_namespace():
    r = resolver({"mm:claim:a:b:r:0": b"x"})
    for tenant in ("a:b", "", "a*", ".."):
        assert refusal(lambda: r.fetch("redis:mm:claim:a:b:r:0", "f", tenant)).code == ErrorCode.INVALID_REQUEST
    # Under a's prefix the key is a's (request id "b:r"): no tenant "a:b" can exist to own it.
    assert r.fetch("redis:mm:claim:a:b:r:0", "f", "a") == b"x"


def test_an_oversized_claim_check_is_refused_without_echoing_it():
    r = resolver({"mm:claim:acme:big:0": b"s3cr3t" * 100}, max_bytes=100)
    e = refusal(lambda: r.fetch("redis:mm:claim:acme:big:0", "f", "acme"))
    assert e.code == ErrorCode.PAYLOAD_TOO_LARGE and "s3cr3t" not in e.message and "600" not in e.message


def test_file_refs_resolve_under_the_tenants_directory_only(tmp_path):
    (tmp_path / "acme").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "acme" / "clip.bin").write_bytes(b"mine")
    (tmp_path / "other" / "clip.bin").write_bytes(b"theirs")
    (tmp_path / "acme" / "escape").symlink_to(tmp_path / "other" / "clip.bin")
    r = resolver(root=tmp_path)
    assert r.fetch(f"file://{tmp_path}/acme/clip.bin", "f", "acme") == b"mine"
    refusals = [refusal(lambda p=p: r.fetch(f"file://{p}", "f", "acme")) for p in (
        tmp_path / "other" / "clip.bin", tmp_path / "acme" / "escape", tmp_path / "acme" / "missing",
        tmp_path / "acme" / ".." / "other" / "clip.bin", "/etc/passwd", tmp_path / "acme")]
    assert {(e.code, e.message) for e in refusals} == {(ErrorCode.INVALID_REQUEST, refusals[0].message)}
    assert str(tmp_path) not in refusals[0].message


def test_a_claim_check_is_read_no_further_than_it_was_priced():
    r = resolver({"mm:claim:acme:r:0": b"x" * 80}, max_bytes=100)
    assert r.fetch("redis:mm:claim:acme:r:0", "parts.0.ref", "acme", priced_bytes=80) == b"x" * 80
    r._redis.values["mm:claim:acme:r:0"] = b"y" * 100  # overwritten with more after the router sized it
    grown = refusal(lambda: r.fetch("redis:mm:claim:acme:r:0", "parts.0.ref", "acme", priced_bytes=80))
    assert grown.code == ErrorCode.PAYLOAD_TOO_LARGE and "admitted" in grown.message


def test_a_file_ref_is_read_no_further_than_it_was_priced(tmp_path):
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "clip").write_bytes(b"z" * 50)
    r = resolver(root=tmp_path, max_bytes=100)
    assert r.fetch(f"file://{tmp_path}/acme/clip", "parts.0.ref", "acme", priced_bytes=50) == b"z" * 50
    grown = refusal(lambda: r.fetch(f"file://{tmp_path}/acme/clip", "parts.0.ref", "acme", priced_bytes=10))
    assert grown.code == ErrorCode.PAYLOAD_TOO_LARGE
