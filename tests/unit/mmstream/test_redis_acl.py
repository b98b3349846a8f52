"""The Redis users written for the local stack: workers vs clients, hashed passwords."""

from __future__ import annotations

import pytest

from mmstream.localstack import redis_acl
from mmstream.localstack.redis_acl import client_rule, credentials, users
from schemas.request import claim_prefix


def test_no_password_no_users():
    assert users("redis://127.0.0.1:6379/0") == []
    assert users("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0") == []


def test_workers_get_mm_keys_clients_get_claim_checks_and_passwords_are_hashed():
    entries = users("redis://mmworker:w%40pass@h:1/0", "redis://mmclient:cpass@h:1/0", admin_password="apass")
    by_name = {u.name: u for u in entries}
    assert set(by_name) == {"mmworker", "mmclient", "mmadmin"}
    assert by_name["mmworker"].password == "w@pass"  # URL-decoded
    assert "~mm:*" in by_name["mmworker"].rule and "-@dangerous" in by_name["mmworker"].rule
    client = by_name["mmclient"].rule
    assert "~mm:claim:*" in client and "-@all" in client and "+get" in client and "+set" in client
    text = redis_acl.acl_file(entries)
    assert text.startswith("user default off\n")
    for secret in ("w@pass", "cpass", "apass"):
        assert secret not in text


def test_a_password_without_a_user_is_the_default_user():
    assert credentials("rediss://:secret@h:6380/0") == ("default", "secret")
    text = redis_acl.acl_file(users("rediss://:secret@h:6380/0"))
    assert "user default off" not in text and text.startswith("user default reset on #")


def test_one_tenants_client_user_sees_only_its_prefix():
    assert client_rule(claim_prefix("acme")).startswith("~mm:claim:acme:* ")
    for bad in ("mm:enc:", "mm:claim:a* ", "mm:claim:a b:"):
        with pytest.raises(ValueError):
            client_rule(bad)


def test_workers_and_clients_must_be_different_users():
    with pytest.raises(ValueError):
        users("redis://same:a@h:1/0", "redis://same:b@h:1/0")
