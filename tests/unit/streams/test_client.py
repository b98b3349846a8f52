"""The SDK's own logic against a fake transport that answers as the pipeline would:
deduplication, retries of retriable errors (honouring retry_after_ms, bounded), the off
switch, and one terminal event per request whatever happens. No broker involved."""

from __future__ import annotations

import asyncio
import random
from typing import AsyncIterator, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import pack, unpack
from schemas.errors import ErrorCode, WireError
from schemas.request import Modality, Part, Request, Task
from streams.sdk.client import Client, ClientError, attempt_id
from streams.sdk.retry import NO_RETRY, RetryConfig, retry_delay_ms
from streams.sdk.transport import TransportError

Script = Callable[[dict, int], list[dict]]  # (request wire map, attempt number) -> events it gets


def event(rid: str, kind: str, seq: int = 0, **extra: object) -> dict:
    return {"v": 1, "id": rid, "kind": kind, "seq": seq, "ts_ms": 0.0, **extra}


def error(rid: str, code: ErrorCode, retry_after_ms: int | None = None) -> dict:
    return event(rid, "error", error=WireError(code, "no", retry_after_ms=retry_after_ms).to_wire())


class FakeTransport:
    """Answers each produced request with the events ``script`` returns for it."""

    def __init__(self, script: Script, fail_start: bool = False) -> None:
        self.script = script
        self.fail_start = fail_start
        self.sent: list[tuple[str, dict]] = []
        self.replies: asyncio.Queue = asyncio.Queue()
        self.closed = 0

    async def start(self, reply_to: str) -> None:
        if self.fail_start:
            raise TransportError("cannot reach Kafka at nowhere:1")
        self.reply_to = reply_to

    async def send(self, topic: str, key: bytes, value: bytes, headers: list) -> None:
        wire = unpack(value)
        assert key.decode() == wire["id"] and wire["reply_to"] == self.reply_to
        self.sent.append((topic, wire))
        for ev in self.script(wire, len(self.sent)):
            self.replies.put_nowait((key, pack(ev)))

    async def records(self) -> AsyncIterator[tuple[bytes | None, bytes]]:
        while True:
            yield await self.replies.get()

    async def close(self) -> None:
        self.closed += 1


class Sleeps:
    def __init__(self) -> None:
        self.seconds: list[float] = []

    async def __call__(self, s: float) -> None:
        self.seconds.append(s)


def request(text: str = "hi", task: Task = Task.EMBED) -> Request:
    return Request(id="req-1", parts=(Part(Modality.TEXT, text=text),), task=task)


async def run(script: Script, retry: RetryConfig = RetryConfig(), task: Task = Task.EMBED):
    transport, sleeps = FakeTransport(script), Sleeps()
    async with Client("fake:1", "t", retry=retry, transport=transport, rng=random.Random(7), sleep=sleeps) as client:
        sub = await client.submit(request(task=task))
        events = [e async for e in sub.events(timeout_s=5)]
    return sub, events, transport, sleeps


async def test_an_overloaded_request_is_sent_again_after_retry_after_and_answered():
    def script(wire: dict, n: int) -> list[dict]:
        if n == 1:
            return [error(wire["id"], ErrorCode.OVERLOADED, retry_after_ms=800)]
        return [event(wire["id"], "accepted"), event(wire["id"], "result", payload={"ok": True})]

    sub, events, transport, sleeps = await run(script)
    assert [e.kind for e in events] == ["accepted", "result"] and all(e.id == "req-1" for e in events)
    assert sub.attempts == 2 and sub.terminal.kind == "result"
    assert [w["id"] for _, w in transport.sent] == ["req-1", "req-1.r2"]
    assert 0.8 <= sleeps.seconds[0] <= 0.8 * 1.2
    assert sub.retries[0]["attempt"] == 1 and sub.retries[0]["error"]["code"] == "overloaded"


async def test_what_is_not_retriable_is_shown_at_once():
    sub, events, transport, sleeps = await run(lambda w, n: [error(w["id"], ErrorCode.INVALID_REQUEST)])
    assert [e.kind for e in events] == ["error"] and len(transport.sent) == 1 and not sleeps.seconds


async def test_attempts_are_bounded_and_the_last_error_is_the_one_terminal():
    retry = RetryConfig(max_attempts=3, base_delay_ms=100, max_total_ms=60_000)
    sub, events, transport, sleeps = await run(lambda w, n: [error(w["id"], ErrorCode.INTERNAL)], retry)
    assert [e.kind for e in events] == ["error"] and sub.attempts == 3 and len(transport.sent) == 3
    assert len(sleeps.seconds) == 2 and all(s >= 1.0 for s in sleeps.seconds)  # internal: retry_after 1000 ms


async def test_total_time_is_bounded():
    retry = RetryConfig(max_attempts=10, max_total_ms=500)
    sub, events, transport, _ = await run(lambda w, n: [error(w["id"], ErrorCode.OVERLOADED, 1000)], retry)
    assert len(transport.sent) == 1 and events[-1].error["code"] == "overloaded"


async def test_off_by_default_and_with_the_off_switch():
    for retry in (NO_RETRY, RetryConfig(max_attempts=1)):
        sub, events, transport, _ = await run(lambda w, n: [error(w["id"], ErrorCode.OVERLOADED, 10)], retry)
        assert len(transport.sent) == 1 and events[-1].kind == "error" and not retry.enabled
    assert Client("fake:1").retry == NO_RETRY


async def test_a_generate_that_streamed_tokens_is_not_retried():
    def script(wire: dict, n: int) -> list[dict]:
        rid = wire["id"]
        return [event(rid, "accepted"), event(rid, "token", 1, payload={"text": "a"}),
                error(rid, ErrorCode.INTERNAL)]

    sub, events, transport, _ = await run(script, task=Task.GENERATE)
    assert [e.kind for e in events] == ["accepted", "token", "error"] and len(transport.sent) == 1


async def test_repeats_are_shown_once_across_attempts():
    def script(wire: dict, n: int) -> list[dict]:
        rid = wire["id"]
        if n == 1:  # accepted, then a retriable failure further down, twice (a stage crashed)
            return [event(rid, "accepted"), error(rid, ErrorCode.DEADLINE_EXCEEDED),
                    error(rid, ErrorCode.DEADLINE_EXCEEDED)]
        return [event(rid, "accepted"), event(rid, "accepted"), event(rid, "result"), event(rid, "result")]

    sub, events, transport, _ = await run(script)
    assert [e.kind for e in events] == ["accepted", "result"] and len(transport.sent) == 2


async def test_an_unreachable_broker_is_a_client_error_and_nothing_stays_open():
    transport = FakeTransport(lambda w, n: [], fail_start=True)
    client = Client("nowhere:1", transport=transport)
    with pytest.raises(ClientError, match="cannot reach Kafka"):
        await client.start()
    await client.close()
    with pytest.raises(ClientError, match="not started"):
        await client.submit_raw("x", b"{}", "application/json")


def test_attempt_ids_stay_valid_ids():
    assert attempt_id("abc", 1) == "abc" and attempt_id("abc", 3) == "abc.r3"
    assert len(attempt_id("x" * 128, 12)) == 128 and attempt_id("x" * 128, 12).endswith(".r12")


# -- the pure policy ------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(attempt=st.integers(1, 10), retry_after=st.one_of(st.none(), st.integers(0, 20_000)),
       elapsed=st.floats(0, 40_000), seed=st.integers(0, 2**32))
def test_delays_honour_retry_after_and_stay_within_bounds(attempt, retry_after, elapsed, seed):
    cfg = RetryConfig(max_attempts=6, base_delay_ms=100, max_delay_ms=2_000, max_total_ms=30_000, jitter=0.2)
    err = {"retriable": True, "retry_after_ms": retry_after}
    delay = retry_delay_ms(cfg, attempt, err, elapsed, random.Random(seed))
    if attempt >= cfg.max_attempts:
        assert delay is None
        return
    if delay is None:  # only the total-time bound may refuse a retriable error within the attempts
        longest = max(min(2_000, 100 * 2 ** (attempt - 1)), (retry_after or 0) * 1.2)
        assert elapsed + longest > cfg.max_total_ms
        return
    backoff = min(2_000, 100 * 2 ** (attempt - 1))
    assert delay >= (retry_after or 0) and delay >= backoff * 0.8
    assert delay <= max(backoff, (retry_after or 0) * 1.2) + 1e-9
    assert elapsed + delay <= cfg.max_total_ms


def test_backoff_doubles_and_jitter_spreads_clients():
    cfg = RetryConfig(base_delay_ms=100, max_delay_ms=10_000, jitter=0.0, max_attempts=8, max_total_ms=1e9)
    err = {"retriable": True}
    assert [retry_delay_ms(cfg, a, err, 0, random.Random(1)) for a in (1, 2, 3)] == [100, 200, 400]
    spread = {round(retry_delay_ms(RetryConfig(), 1, {"retriable": True, "retry_after_ms": 1000}, 0,
                                   random.Random(s)), 3) for s in range(20)}
    assert len(spread) > 10 and min(spread) >= 1000
    assert retry_delay_ms(RetryConfig(), 1, {"retriable": False, "retry_after_ms": 5}, 0, random.Random()) is None
    assert retry_delay_ms(RetryConfig(), 1, None, 0, random.Random()) is None
    with pytest.raises(ValueError):
        RetryConfig(max_attempts=0)
