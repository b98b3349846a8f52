"""The async client SDK: produce requests, follow their events on the reply topic.

    async with Client(bootstrap="127.0.0.1:9092", retry=RetryConfig()) as client:
        sub = await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="hi"),)))
        async for event in sub.events():
            print(event.kind)

As a tenant of a secured deployment, from the client properties file `mmstream tenant add`
wrote (the tenant is the SASL user; requests go to its own ingress topics, answers come
from its own reply topic):

    async with Client.from_properties("acme.properties", topic_prefix="mm") as client: ...

Events are deduplicated: every stage is at-least-once, so after a crash a stage may repeat
an event; the client shows each (kind, seq) of a request once, and exactly one terminal.

Retries (``retry=RetryConfig(...)``; off by default, so benchmarks and tools see the
pipeline's answers as they are): a terminal error marked ``retriable`` is not shown; the
request is sent again after the delay ``streams.sdk.retry`` computes (jittered backoff, never
before ``retry_after_ms``, bounded in attempts and total time), and the client shows the
last attempt's terminal event. Each resend carries its own wire id (``<id>.r<n>``, so no
stage mistakes it for a late duplicate of the failed attempt); events are shown under the
request's own id. A generate request that already streamed tokens is not retried (the
caller has seen part of an answer). ``Submission.retries`` lists what was retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from schemas.codec import CONTENT_TYPE_HEADER, MSGPACK, DecodeError, pack, unpack
from schemas.events import Event, EventKind
from schemas.documents import MAX_DOC_ID_BYTES, Document
from schemas.request import COLLECTION_RE, Lane, Modality, Params, Part, Request, Task, claim_key
from schemas.topics import TopicNames, valid_tenant
from schemas.trace import now_ms
from streams.connection import KafkaSecurity, connect_redis_async, read_properties, read_redis_url
from streams.sdk.retry import NO_RETRY, RetryConfig, retry_delay_ms
from streams.sdk.transport import KafkaTransport, Transport, TransportError

MAX_EVENTS_PER_REQUEST = 4096
MAX_ID_CHARS = 128


def new_id() -> str:
    return uuid.uuid4().hex


def attempt_id(request_id: str, attempt: int) -> str:
    """The wire id of ``attempt`` (1-based) of ``request_id``: the id itself for the first."""
    if attempt == 1:
        return request_id
    suffix = f".r{attempt}"
    return request_id[:MAX_ID_CHARS - len(suffix)] + suffix


class ClientError(RuntimeError):
    """The client could not do what it was asked (not a request error: those are events)."""


@dataclass
class Submission:
    id: str
    sent_at_ms: float
    _queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_EVENTS_PER_REQUEST), repr=False)
    terminal: Event | None = None
    terminal_at_ms: float | None = None
    attempts: int = 1
    """Sends so far, the first included."""
    retries: list[dict[str, Any]] = field(default_factory=list)
    """One entry per retried error: ``{"attempt", "error", "delay_ms"}``."""
    submitted_at_ms: float = field(default_factory=now_ms)
    """When ``submit`` was called (wall clock, ms). ``sent_at_ms`` is the same unless the
    caller dates the request otherwise: a load generator dates it by its schedule, and the
    difference is how far the generator itself fell behind."""
    _request: Request | None = field(default=None, repr=False)
    _first_sent: float = field(default_factory=time.monotonic, repr=False)
    _streamed: bool = field(default=False, repr=False)
    _resend_pending: bool = field(default=False, repr=False)

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
    """Sends requests through a ``Transport`` (Kafka by default) and follows their events."""

    def __init__(self, bootstrap: str, topic_prefix: str = "mm", reply_to: str | None = None,
                 max_request_bytes: int = 8 * 1024 * 1024, redis_url: str | None = None,
                 inline_limit_bytes: int = 1024 * 1024, claim_ttl_s: int = 3600,
                 retry: RetryConfig = NO_RETRY, transport: Transport | None = None,
                 rng: random.Random | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 security: KafkaSecurity | None = None, tenant: str | None = None,
                 redis_tls_ca: str | None = None) -> None:
        """``redis_url``: where parts over ``inline_limit_bytes`` are stored (claim check
        under the request's tenant, ``mm:claim:<tenant>:<id>:<part>``, kept ``claim_ttl_s``;
        a clients' user that may only SET and GET those keys is enough; ``redis_tls_ca``
        for a ``rediss://`` URL); without it such parts are refused by ``submit``. ``retry``:
        see the module docstring. ``security``: how to authenticate (default PLAINTEXT).
        ``tenant``: send as this tenant of a secured deployment (its own ingress topics,
        its reply topic by default, its name in every request); None: the shared topics.
        ``transport``, ``rng`` and ``sleep`` are for tests."""
        if tenant is not None and not valid_tenant(tenant):
            raise ClientError(f"{tenant!r} is not a tenant name (lowercase letters, digits, _ and -)")
        self.tenant = tenant
        self.bootstrap = bootstrap
        self.redis_url = redis_url
        self.redis_tls_ca = redis_tls_ca
        self.inline_limit_bytes = inline_limit_bytes
        self.claim_ttl_s = claim_ttl_s
        self._redis: Any = None
        self.prefix = topic_prefix
        self.names = TopicNames(topic_prefix)
        self.reply_to = reply_to or (self.names.results if tenant is None else self.names.tenant_results(tenant))
        self.max_request_bytes = max_request_bytes
        self.retry = retry
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._transport: Transport = transport or KafkaTransport(
            bootstrap, max_request_bytes, (security or KafkaSecurity()).aiokafka_kwargs())
        self._pending: dict[str, Submission] = {}  # wire id -> its submission
        self._seen: dict[str, set[tuple[str, int]]] = {}  # request id -> (kind, seq) shown
        self._reader: asyncio.Task | None = None
        self._resends: set[asyncio.Task] = set()
        self._started = False

    @classmethod
    def from_properties(cls, path: str | Path, topic_prefix: str = "mm", **kwargs: Any) -> "Client":
        """A client for the tenant a properties file describes (`mmstream tenant add` writes
        one): bootstrap servers and credentials from the file, the tenant is its
        ``sasl.username``; claim checks go to the tenant's own Redis user when the file names
        one (``mmstream.redis.url``, which then wins over ``redis_url``). Other keyword
        arguments as for ``Client``."""
        bootstrap, security = read_properties(Path(path))
        kwargs.setdefault("tenant", security.username or None)
        kwargs["redis_url"] = read_redis_url(Path(path)) or kwargs.get("redis_url")
        return cls(bootstrap, topic_prefix, security=security, **kwargs)

    def ingress(self, lane: str) -> str:
        """The topic this client's requests of ``lane`` go to."""
        return self.names.ingress(lane) if self.tenant is None else self.names.tenant_ingress(lane, self.tenant)

    async def __aenter__(self) -> "Client":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect. Raises ``ClientError`` when the broker cannot be reached or the reply
        topic does not exist (nothing is left open)."""
        try:
            await self._transport.start(self.reply_to)
        except TransportError as exc:
            with contextlib.suppress(Exception):
                await self.close()
            raise ClientError(str(exc)) from None
        except BaseException:  # nothing is left open, and the original error is the one reported
            with contextlib.suppress(Exception):
                await self.close()
            raise
        self._started = True
        self._reader = asyncio.create_task(self._read(), name="mmstream-client-reader")

    async def close(self) -> None:
        """Stop reading and close every connection; safe to call twice or after a failed start."""
        tasks = [t for t in (self._reader, *self._resends) if t is not None]
        self._reader, self._resends = None, set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._started = False
        await self._transport.close()
        redis, self._redis = self._redis, None
        if redis is not None:
            await redis.aclose()

    async def submit(self, request: Request) -> Submission:
        """Produce ``request`` to its lane's ingress topic; return its ``Submission``.

        Parts whose bytes are over the inline limit are stored in Redis first and sent as a
        ``redis:`` claim check. Raises ``ClientError`` when that is needed and not possible.
        """
        if self.tenant is not None and request.tenant == "default":
            request = dataclasses.replace(request, tenant=self.tenant)
        request = await self._claim_check(request)
        if request.reply_to is None:
            request = dataclasses.replace(request, reply_to=self.reply_to)
        sub = self._track(Submission(request.id, now_ms(), _request=request if self.retry.enabled else None),
                          request.id)
        await self._send_request(request, request.id)
        return sub

    async def submit_raw(self, request_id: str, value: bytes, content_type: str, lane: str = "rt") -> Submission:
        """Produce already-encoded request bytes (MessagePack or JSON) and follow ``request_id``.

        For tools and tests that need to send exactly these bytes, malformed ones included;
        they are never retried (the client cannot give a resend its own id).
        """
        if not self._started:
            raise ClientError("client not started")
        sub = self._track(Submission(request_id, now_ms()), request_id)
        await self._transport.send(self.ingress(lane), request_id.encode(), value,
                                   [(CONTENT_TYPE_HEADER, content_type.encode())])
        return sub

    # -- collections (docs/retrieval.md) ------------------------------------------------------

    def collection_topic(self, collection: str) -> str:
        """The documents topic of this client's tenant's ``collection`` (``default``'s in
        plaintext mode). `mmstream collection add` creates it."""
        return self.names.docs(self.tenant or "default", collection)

    async def put_document(self, collection: str, doc_id: str, text: str,
                           meta: dict[str, Any] | None = None) -> None:
        """Add or replace one passage (indexed in the background; a search sees it once the
        retrieve stage has applied its vector)."""
        value = pack(Document(text, dict(meta or {})).to_wire())
        await self._send_document(collection, doc_id, value)

    async def put_image(self, collection: str, doc_id: str, image: bytes | None = None, mime: str = "image/jpeg",
                        caption: str = "", meta: dict[str, Any] | None = None, ref: str | None = None) -> None:
        """Add or replace one image document: its bytes inline, or ``ref``, a claim check of this
        tenant's (``redis:<key>``). Image queries find it; ``caption`` is the text its hits show."""
        if (image is None) == (ref is None):
            raise ClientError("an image document has its bytes or a ref, exactly one of them")
        value = pack(Document(caption, dict(meta or {}), image, ref, mime).to_wire())
        await self._send_document(collection, doc_id, value)

    async def delete_document(self, collection: str, doc_id: str) -> None:
        """Remove one document: a tombstone on the collection topic."""
        await self._send_document(collection, doc_id, None)

    async def _send_document(self, collection: str, doc_id: str, value: bytes | None) -> None:
        if not self._started:
            raise ClientError("client not started")
        if not COLLECTION_RE.fullmatch(collection):
            raise ClientError(f"{collection!r} is not a collection name (a-z 0-9 _ -, a letter or digit first)")
        key = doc_id.encode()
        if not key or len(key) > MAX_DOC_ID_BYTES:
            raise ClientError(f"a document id is 1-{MAX_DOC_ID_BYTES} bytes of UTF-8")
        await self._transport.send(self.collection_topic(collection), key, value,  # type: ignore[arg-type]
                                   [(CONTENT_TYPE_HEADER, MSGPACK.encode())])

    async def retrieve(self, collection: str, query: str | Part, k: int | None = None,
                       where: dict[str, Any] | None = None, lane: str = "rt",
                       deadline_ms: int | None = None, request_id: str | None = None) -> Submission:
        """Search ``collection`` with ``query`` (text, or a ``Part`` of another modality);
        the result event's payload holds ``hits`` (id, score, text, meta), best first."""
        part = query if isinstance(query, Part) else Part(Modality.TEXT, text=query)
        return await self.submit(Request(id=request_id or new_id(), parts=(part,), task=Task.RETRIEVE,
                                         params=Params(collection=collection, k=k, where=where),
                                         lane=Lane(lane), deadline_ms=deadline_ms))

    def _track(self, sub: Submission, wire_id: str) -> Submission:
        self._pending[wire_id] = sub
        self._seen.setdefault(sub.id, set())
        return sub

    async def _send_request(self, request: Request, wire_id: str) -> None:
        if not self._started:
            raise ClientError("client not started")
        wire = request.to_wire()
        wire["id"] = wire_id
        await self._transport.send(self.ingress(str(request.lane)), wire_id.encode(), pack(wire),
                                   [(CONTENT_TYPE_HEADER, MSGPACK.encode())])

    async def _claim_check(self, request: Request) -> Request:
        big = [i for i, p in enumerate(request.parts) if p.data is not None and len(p.data) > self.inline_limit_bytes]
        if not big:
            return request
        if self.redis_url is None:
            raise ClientError(f"part {big[0]} is over the inline limit of {self.inline_limit_bytes} bytes and the "
                              "client has no redis_url for a claim check")
        if self._redis is None:
            self._redis = connect_redis_async(self.redis_url, self.redis_tls_ca)
        parts = list(request.parts)
        for i in big:
            key = claim_key(request.tenant, request.id, i)
            await self._redis.set(key, parts[i].data, ex=self.claim_ttl_s)
            parts[i] = dataclasses.replace(parts[i], data=None, ref=f"redis:{key}")
        return dataclasses.replace(request, parts=tuple(parts))

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (its later events are dropped)."""
        for wire_id in [w for w, sub in self._pending.items() if sub.id == request_id]:
            del self._pending[wire_id]
        self._seen.pop(request_id, None)

    async def _read(self) -> None:
        async for key, value in self._transport.records():
            wire_id = key.decode("utf-8", "replace") if key else ""
            sub = self._pending.get(wire_id)
            if sub is None:
                continue
            try:
                event = Event.from_wire(unpack(value))
            except (DecodeError, ValueError):
                continue
            if event.id != sub.id:
                event = dataclasses.replace(event, id=sub.id)  # a resend's events, under the request's id
            if event.terminal and self._retry_later(sub, wire_id, event):
                continue
            seen = self._seen.setdefault(sub.id, set())
            mark = ("terminal", 0) if event.terminal else (str(event.kind), event.seq)
            if mark in seen:
                continue  # a repeat after some stage's crash (or a resend's accepted): shown once
            seen.add(mark)
            if event.kind == EventKind.TOKEN:
                sub._streamed = True
            if event.terminal:
                self._finish(sub, event)
            try:
                sub._queue.put_nowait(event)
            except asyncio.QueueFull:
                pass  # a consumer that never reads its events loses the oldest-first overflow

    def _retry_later(self, sub: Submission, wire_id: str, event: Event) -> bool:
        """Schedule a resend of ``sub`` if ``event`` is a retriable error worth retrying."""
        if sub._request is None or sub._streamed or event.kind != EventKind.ERROR:
            return False
        if sub._resend_pending or attempt_id(sub.id, sub.attempts) != wire_id:
            return True  # a repeated terminal of an attempt already retried: swallowed
        elapsed_ms = (time.monotonic() - sub._first_sent) * 1000.0
        delay = retry_delay_ms(self.retry, sub.attempts, event.error, elapsed_ms, self._rng)
        if delay is None:
            return False
        sub.retries.append({"attempt": sub.attempts, "error": event.error, "delay_ms": delay})
        sub._resend_pending = True
        task = asyncio.create_task(self._resend(sub, delay, event), name=f"mmstream-resend-{sub.id}")
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)
        return True

    async def _resend(self, sub: Submission, delay_ms: float, last: Event) -> None:
        await self._sleep(delay_ms / 1000.0)
        sub.attempts += 1
        sub._resend_pending = False
        wire_id = attempt_id(sub.id, sub.attempts)
        self._pending[wire_id] = sub
        try:
            assert sub._request is not None
            await self._send_request(sub._request, wire_id)
        except Exception:  # noqa: BLE001 - the caller still gets exactly one terminal: the last error
            self._pending.pop(wire_id, None)
            self._finish(sub, last)
            sub._queue.put_nowait(last)

    def _finish(self, sub: Submission, event: Event) -> None:
        sub.terminal = event
        sub.terminal_at_ms = now_ms()
        for wire_id in [w for w, s in self._pending.items() if s is sub]:
            del self._pending[wire_id]
        self._seen.pop(sub.id, None)


async def wait_until_serving(bootstrap: str, topic_prefix: str, timeout_s: float = 180.0,
                             security: KafkaSecurity | None = None, task: Task = Task.EMBED) -> float:
    """Send small probe requests (of ``task``: ``GENERATE`` waits for a generator too) until
    one is answered end to end; return the seconds it took.

    Raises ``TimeoutError`` when none is answered within ``timeout_s``.
    """
    start = time.monotonic()
    params = Params(max_tokens=1) if task == Task.GENERATE else Params()
    async with Client(bootstrap, topic_prefix, security=security) as client:
        while time.monotonic() - start < timeout_s:
            sub = await client.submit(Request(id=f"probe-{new_id()}", parts=(Part(Modality.TEXT, text="probe"),),
                                              task=task, params=params, deadline_ms=10_000))
            try:
                if (await sub.result(timeout_s=15)).kind == "result":
                    return time.monotonic() - start
            except asyncio.TimeoutError:
                client.forget(sub.id)
            await asyncio.sleep(0.5)
    raise TimeoutError(f"no probe request was answered within {timeout_s:.0f} s")
