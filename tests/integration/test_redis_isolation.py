"""Tenants and Redis (issue 22, item 5) on real Redis servers: the secured Redis of
`mmstream up --secure` with one user per tenant, and the claim sweep that bounds what each
tenant keeps there.

The secured Redis here is this test's own (a state dir and port of its own, never a
developer's); the sweep runs on the suite's Redis in a database of its own (db 9), so it
sees only this test's claim checks.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import redis

from mmstream import localstack
from schemas.request import claim_key
from schemas.settings import Settings
from streams.stores import claim_sweep
from tests.integration.conftest import free_ports
from workers.redisconn import connect_async

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def secured(tmp_path):
    (port,) = free_ports(1)
    settings = Settings.from_env({**os.environ, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path),
                                  "MMSTREAM_LOCAL_REDIS_SECURE_PORT": str(port)})
    server = localstack.secure_redis(settings, REPO)
    server.start()
    yield settings, server
    server.stop()


def test_up_secure_redis_has_no_open_door_and_each_tenant_reaches_only_its_own_claims(secured):
    settings, server = secured
    assert server.secured and urlport(server.url) == settings.local.redis_secure_port
    with pytest.raises(redis.AuthenticationError):  # the default user is off: no password, no entry
        redis.Redis(port=server.port, socket_timeout=2).get("x")
    for tenant in ("acme", "globex"):
        server.add_client_user(tenant, f"{tenant}-pw", tenant)
    acme = redis.Redis.from_url(server.user_url("acme", "acme-pw"))
    mine, theirs = claim_key("acme", "r1", 0), claim_key("globex", "r1", 0)
    assert acme.set(mine, b"bytes", ex=60) and acme.get(mine) == b"bytes"
    worker = redis.Redis.from_url(server.url)  # the workers' user reads every tenant's claims
    worker.set(theirs, b"secret", ex=60)
    assert worker.get(mine) == b"bytes"
    for denied in (lambda: acme.get(theirs), lambda: acme.set("mm:cache:forged", b"x"),
                   lambda: acme.delete(mine), lambda: acme.keys("*"), lambda: acme.config_get("*"),
                   lambda: acme.execute_command("SELECT", 3)):  # no database the sweep does not see
        with pytest.raises(redis.exceptions.NoPermissionError):
            denied()
    # A tenant's users survive a restart of the server (kept in its ACL file).
    server.stop()
    server.start()
    assert redis.Redis.from_url(server.user_url("acme", "acme-pw")).get(mine) is None  # a cache: values go
    assert redis.Redis.from_url(server.user_url("acme", "acme-pw")).set(mine, b"again", ex=60)


def test_secure_env_points_workers_at_the_secured_redis_as_their_user(secured):
    settings, server = secured
    env = localstack.secure_env(settings, REPO)
    assert env["MMSTREAM_REDIS_URL"] == server.url and "mmworker:" in server.url
    assert localstack.redis_for(Settings.from_env({**os.environ, **env, "MMSTREAM_LOCAL_STATE_DIR":
                                                   str(settings.local.state_dir),
                                                   "MMSTREAM_LOCAL_REDIS_SECURE_PORT": str(server.port)}),
                                REPO).root == server.root
    path = localstack.write_secure_env(settings, REPO)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and server.url in path.read_text()


def test_the_servers_largest_value_is_the_largest_ref(infra):
    ours = localstack.redis_for(infra, REPO).status()
    if ours.pid is None:
        pytest.skip("the suite's Redis was not started from infra/redis/redis.conf")
    r = redis.Redis.from_url(infra.redis.url)
    assert int(r.config_get("proto-max-bulk-len")["proto-max-bulk-len"]) == 64 * 1024 * 1024


async def test_the_claim_sweep_caps_lives_and_cuts_a_tenant_over_its_quota_back_newest_first(infra):
    url = infra.redis.url.rsplit("/", 1)[0] + "/9"
    plain = redis.Redis.from_url(url)
    plain.flushdb()
    hog, calm = f"hog{uuid.uuid4().hex[:6]}", f"calm{uuid.uuid4().hex[:6]}"
    for i in range(10):  # the hog: 10 x 1000 bytes, the last ones without an expiry at all
        plain.set(claim_key(hog, f"r{i}", 0), b"h" * 1000, ex=100 + i * 100 if i < 8 else None)
    plain.set(claim_key(calm, "r", 0), b"c" * 3000)  # under its quota, but stored forever
    client = connect_async(url)
    try:
        plan = await claim_sweep.sweep(client, quota_bytes=4500, max_ttl_s=600)
    finally:
        await client.aclose()
    left = {k.decode(): plain.ttl(k) for k in plain.scan_iter(f"mm:claim:{hog}:*")}
    assert sorted(left) == sorted(claim_key(hog, f"r{i}", 0) for i in range(4))  # the oldest four: 4000 <= 4500
    assert all(0 < ttl <= 600 for ttl in left.values())
    assert plain.exists(claim_key(calm, "r", 0)) and 0 < plain.ttl(claim_key(calm, "r", 0)) <= 600
    assert plan.deleted_bytes == {hog: 6000} and plan.stored_bytes[calm] == 3000
    plain.flushdb()


def urlport(url: str) -> int:
    from urllib.parse import urlsplit

    return urlsplit(url).port or 0
