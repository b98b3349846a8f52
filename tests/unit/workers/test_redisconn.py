"""Redis clients fail fast: a refused connection is the call's error, and a connect is bounded."""

import asyncio
import socket
import pytest
import redis

from workers import redisconn


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_clients_never_wait_unbounded_to_connect():
    sync = redisconn.connect("redis://127.0.0.1:6399/0")
    assert sync.connection_pool.connection_kwargs["socket_connect_timeout"] == redisconn.CONNECT_TIMEOUT_S
    aio = redisconn.connect_async("redis://127.0.0.1:6399/0", socket_connect_timeout=0.1)
    assert aio.connection_pool.connection_kwargs["socket_connect_timeout"] == 0.1  # the caller's wins


def test_a_refused_connection_is_an_error_of_the_call_itself():
    port = _closed_port()
    client = redisconn.connect(f"redis://127.0.0.1:{port}/0", socket_timeout=0.05)
    with pytest.raises(redis.ConnectionError):
        client.get("k")

    async def aio() -> None:
        c = redisconn.connect_async(f"redis://127.0.0.1:{port}/0", socket_timeout=0.05)
        with pytest.raises(redis.ConnectionError):
            await c.get("k")
        await c.aclose()

    asyncio.run(aio())
