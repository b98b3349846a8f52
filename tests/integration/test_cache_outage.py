"""The reuse cache through a Redis kill -9 and restart, on a real Redis of the test's own:
while Redis is away every call answers "unavailable" in the call itself and the breaker
opens; after the restart the cache is back once the breaker's first, short cool-down has
passed (the clock is the test's), not after the cap."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from workers.breaker import CircuitBreaker
from workers.cache import EncoderCache

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    import redis

    probe = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(100):
        try:
            probe.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    probe.close()
    return proc


def test_the_cache_is_back_one_short_cooldown_after_a_restart(infra) -> None:
    """(``infra``: the local stack is up, so redis-server is installed; a fresh machine has
    none until then, and a skip decided at collection would hide this test there.)"""
    port = _free_port()
    proc = _start(port)
    clock = Clock()
    breaker = CircuitBreaker(failures_to_open=3, cooldown_s=10.0, first_cooldown_s=0.25)
    cache = EncoderCache(f"redis://127.0.0.1:{port}/0", ttl_s=60, timeout_s=0.5, breaker=breaker, clock=clock)
    try:
        assert cache.set_many([("k", b"v")])
        proc.kill()
        proc.wait()
        for _ in range(3):
            assert cache.get_many(["k"]) is None  # away: "unavailable", from the call itself
        assert breaker.state == "open" and breaker.current_cooldown_s == 0.25
        clock.now += 0.1
        assert cache.get_many(["k"]) is None and not breaker.allow(clock.now)  # skipped, not tried
        proc = _start(port)  # back, empty
        clock.now += 0.2  # past the first cool-down, far inside the 10 s cap
        assert cache.get_many(["k"]) == [None]  # tried again and answered (a miss: Redis restarted empty)
        assert breaker.state == "closed"
        assert cache.set_many([("k", b"v2")]) and cache.get_many(["k"]) == [b"v2"]
    finally:
        proc.kill()
        proc.wait()
