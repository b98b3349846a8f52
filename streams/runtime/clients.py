"""Starting and closing a stage's Kafka clients: a stage that starts while its broker is away
keeps trying instead of exiting, and a producer being replaced is closed without waiting on it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from aiokafka.errors import KafkaConnectionError

log = logging.getLogger(__name__)

START_RETRY_BASE_S = 0.2
START_RETRY_MAX_S = 2.0
START_TIMEOUT_S = 180.0
"""A stage that starts while the broker is away (restarting, failing over) keeps trying to
reach it, with backoff from ``START_RETRY_BASE_S`` to ``START_RETRY_MAX_S``, for this long
before it gives up: a worker that exits instead leaves its partitions unserved for good (the
broker chaos scenario lost every generate request to a generator that started during the
broker's restart and exited on "Unable to bootstrap")."""


async def start_when_reachable(make: Callable[[], Any], what: str, timeout_s: float = START_TIMEOUT_S) -> Any:
    """A client from ``make()``, started; while the broker cannot be reached a fresh one is
    tried again with backoff (see ``START_TIMEOUT_S``); raises the last error after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = START_RETRY_BASE_S
    while True:
        client = make()
        try:
            await client.start()
            return client
        except KafkaConnectionError as exc:
            await close_quietly(client)  # it never fully started: nothing of it to keep
            if loop.time() + delay >= deadline:
                raise
            log.warning("%s: the broker cannot be reached (%r); trying again in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(START_RETRY_MAX_S, delay * 2)
        except BaseException:  # any other failure, or the start cancelled: nothing of it left open
            await close_quietly(client)
            raise


async def close_quietly(client: Any, timeout_s: float = 5.0) -> None:
    """Stop a Kafka client being replaced or given up (a producer, a consumer that failed to
    start), whatever state it is in: bounded, and its errors only logged (the caller's own
    error, if any, is the one that matters)."""
    if client is None:
        return
    try:
        await asyncio.wait_for(client.stop(), timeout_s)
    except Exception as exc:  # a replaced producer's batches were failed already; nothing of it is needed
        log.info("closing a Kafka client: %r", exc)
