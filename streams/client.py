"""The async client SDK: produce requests, follow their events on the reply topic.

    async with Client(bootstrap="127.0.0.1:9092") as client:
        sub = await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="hi"),)))
        async for event in sub.events():
            print(event.kind)

Events are deduplicated: every stage is at-least-once, so after a crash a stage may repeat
an event; the client shows each (kind, seq) of a request once, and exactly one terminal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from schemas.codec import CONTENT_TYPE_HEADER, MSGPACK, DecodeError, pack, unpack
from schemas.events import Event
from schemas.request import Modality, Part, Request
from schemas.trace import now_ms

MAX_EVENTS_PER_REQUEST = 4096


def new_id() -> str:
    return uuid.uuid4().hex


class ClientError(RuntimeError):
    """The client could not do what it was asked (not a request error: those are events)."""


@dataclass
class Submission:
    id: str
    sent_at_ms: float
    _queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_EVENTS_PER_REQUEST), repr=False)
    terminal: Event | None = None
    terminal_at_ms: float | None = None

    async def events(self, timeout_s: float | None = None) -> AsyncIterator[Event]:
        """Every event of this request in arrival order, ending with its terminal event.

        Raises ``asyncio.TimeoutError`` if no event arrives within ``timeout_s``.
        """
        while True:
            event = await asyncio.wait_for(self._queue.get(), timeout_s)
            yield event
            if event.terminal:
                return

    async def result(self, timeout_s: float | None = None) -> Event:
        """The terminal event (``result`` or ``error``)."""
        async for event in self.events(timeout_s):
            if event.terminal:
                return event
        raise ClientError("event stream ended without a terminal event")  # unreachable by contract


class Client:
    """One producer for requests and one partition-assigned consumer of the reply topic."""

    def __init__(self, bootstrap: str, topic_prefix: str = "mm", reply_to: str | None = None,
                 max_request_bytes: int = 8 * 1024 * 1024, redis_url: str | None = None,
                 inline_limit_bytes: int = 1024 * 1024, claim_ttl_s: int = 3600) -> None:
        """``redis_url``: where parts over ``inline_limit_bytes`` are stored (claim check,
        kept ``claim_ttl_s``); without it such parts are refused by ``submit``."""
        self.bootstrap = bootstrap
        self.redis_url = redis_url
        self.inline_limit_bytes = inline_limit_bytes
        self.claim_ttl_s = claim_ttl_s
        self._redis: Any = None
        self.prefix = topic_prefix
        self.reply_to = reply_to or f"{topic_prefix}.results"
        self.max_request_bytes = max_request_bytes
        self._pending: dict[str, Submission] = {}
        self._seen: dict[str, set[tuple[str, int]]] = {}
        self._producer = None
        self._consumer = None
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "Client":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect the producer and the reply consumer.

        Raises ``ClientError`` when the broker cannot be reached or the reply topic does not
        exist; whatever was opened is closed again first (no "Unclosed AIOKafkaProducer").
        """
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
        from aiokafka.errors import KafkaConnectionError

        try:
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=1,
                                              max_request_size=self.max_request_bytes, acks=1)
            await self._producer.start()
            self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                              fetch_max_wait_ms=5, auto_offset_reset="latest")
            await self._consumer.start()
            partitions = self._consumer.partitions_for_topic(self.reply_to)
            if partitions is None:
                await self._consumer._client.force_metadata_update()  # first contact may lack it
                partitions = self._consumer.partitions_for_topic(self.reply_to)
        except KafkaConnectionError:
            await self.close()
            raise ClientError(f"cannot reach Kafka at {self.bootstrap}: is it running? (start it with `mmstream up`, "
                              "or point MMSTREAM_KAFKA_BOOTSTRAP at your cluster)") from None
        except BaseException:
            await self.close()
            raise
        if not partitions:
            await self.close()
            raise ClientError(f"reply topic {self.reply_to} does not exist: is the pipeline up (mmstream up)?")
        tps = [TopicPartition(self.reply_to, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:  # resolve positions now, so no event sent after submit() is missed
            await self._consumer.position(tp)
        self._reader = asyncio.create_task(self._read(), name="mmstream-client-reader")

    async def close(self) -> None:
        """Stop reading and close every connection; safe to call twice or after a failed start."""
        if self._reader:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        consumer, producer, redis = self._consumer, self._producer, self._redis
        self._reader = self._consumer = self._producer = self._redis = None
        if consumer is not None:
            await consumer.stop()
        if producer is not None:
            await producer.stop()
        if redis is not None:
            await redis.aclose()

    async def submit(self, request: Request) -> Submission:
        """Produce ``request`` to its lane's ingress topic; return its ``Submission``.

        Parts whose bytes are over the inline limit are stored in Redis first and sent as a
        ``redis:`` claim check. Raises ``ClientError`` when that is needed and not possible.
        """
        request = await self._claim_check(request)
        wire = request.to_wire()
        if request.reply_to is None:
            wire["reply_to"] = self.reply_to
        return await self.submit_raw(request.id, pack(wire), MSGPACK, str(request.lane))

    async def submit_raw(self, request_id: str, value: bytes, content_type: str, lane: str = "rt") -> Submission:
        """Produce already-encoded request bytes (MessagePack or JSON) and follow ``request_id``.

        For tools and tests that need to send exactly these bytes, malformed ones included.
        """
        if self._producer is None:
            raise ClientError("client not started")

        sub = Submission(request_id, now_ms())
        self._pending[request_id] = sub
        self._seen[request_id] = set()
        await self._producer.send_and_wait(f"{self.prefix}.ingress.{lane}", value, key=request_id.encode(),
                                           headers=[(CONTENT_TYPE_HEADER, content_type.encode())])
        return sub

    async def _claim_check(self, request: Request) -> Request:
        big = [i for i, p in enumerate(request.parts) if p.data is not None and len(p.data) > self.inline_limit_bytes]
        if not big:
            return request
        if self.redis_url is None:
            raise ClientError(f"part {big[0]} is over the inline limit of {self.inline_limit_bytes} bytes and the "
                              "client has no redis_url for a claim check")
        if self._redis is None:
            import redis.asyncio

            self._redis = redis.asyncio.Redis.from_url(self.redis_url)
        parts = list(request.parts)
        for i in big:
            key = f"mm:claim:{request.id}:{i}"
            await self._redis.set(key, parts[i].data, ex=self.claim_ttl_s)
            parts[i] = dataclasses.replace(parts[i], data=None, ref=f"redis:{key}")
        return dataclasses.replace(request, parts=tuple(parts))

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (its later events are dropped)."""
        self._pending.pop(request_id, None)
        self._seen.pop(request_id, None)

    async def _read(self) -> None:
        assert self._consumer is not None
        async for record in self._consumer:
            sub = self._pending.get(record.key.decode("utf-8", "replace") if record.key else "")
            if sub is None:
                continue
            try:
                event = Event.from_wire(unpack(record.value))
            except (DecodeError, ValueError):
                continue
            seen = self._seen[sub.id]
            mark = ("terminal", 0) if event.terminal else (str(event.kind), event.seq)
            if mark in seen:
                continue  # a repeat after some stage's crash: shown once
            seen.add(mark)
            if event.terminal:
                sub.terminal = event
                sub.terminal_at_ms = now_ms()
                self._pending.pop(sub.id, None)
                self._seen.pop(sub.id, None)
            try:
                sub._queue.put_nowait(event)
            except asyncio.QueueFull:
                pass  # a consumer that never reads its events loses the oldest-first overflow


async def wait_until_serving(bootstrap: str, topic_prefix: str, timeout_s: float = 180.0) -> float:
    """Send small probe requests until one is answered end to end; return the seconds it took.

    Raises ``TimeoutError`` when none is answered within ``timeout_s``.
    """
    import time


    start = time.monotonic()
    async with Client(bootstrap, topic_prefix) as client:
        while time.monotonic() - start < timeout_s:
            sub = await client.submit(Request(id=f"probe-{new_id()}", parts=(Part(Modality.TEXT, text="probe"),),
                                              deadline_ms=10_000))
            try:
                if (await sub.result(timeout_s=15)).kind == "result":
                    return time.monotonic() - start
            except asyncio.TimeoutError:
                client.forget(sub.id)
            await asyncio.sleep(0.5)
    raise TimeoutError(f"no probe request was answered within {timeout_s:.0f} s")
