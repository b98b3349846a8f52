"""Where a request's answers may go (``reply_to``), and which topics exist.

Never to an internal topic (``TopicNames.is_internal``: the ingress, encode, encoded,
generate, done and DLQ topics, changelogs) in any mode; a tenant's request (an authenticated
sender, ``tenant`` given) only inside its own reply namespace (``<p>.results.<tenant>`` or
``<p>.results.<tenant>.*``); a topic other than the default only when it exists (a request
must not create topics by naming them).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Awaitable, Callable

from aiokafka.admin import AIOKafkaAdminClient

from schemas.errors import ErrorCode, WireError
from schemas.topics import TopicNames


class ReplyTopics:
    """The reply-topic rules of one pipeline; ``topic_exists`` is injected (``TopicCache``)."""

    def __init__(self, topics: TopicNames, topic_exists: Callable[[str], Awaitable[bool]]) -> None:
        self.topics = topics
        self.topic_exists = topic_exists

    def default(self, tenant: str | None) -> str:
        """Where answers go when a request names no reply topic (None: a trusted sender)."""
        return self.topics.results if tenant is None else self.topics.tenant_results(tenant)

    async def check(self, asked: str | None, tenant: str | None) -> str:
        """The reply topic of a request from ``tenant`` (None: a trusted sender) that asked for
        ``asked``; raises ``WireError`` (field ``reply_to``) when it may not be used."""
        if not asked:
            return self.default(tenant)
        if tenant is not None and not self.topics.in_reply_namespace(asked, tenant):
            raise WireError(ErrorCode.INVALID_REQUEST,
                            f"reply_to must be {self.topics.tenant_results(tenant)!r} or a topic under "
                            f"{self.topics.tenant_results(tenant) + '.'!r} (your own reply topics)", "reply_to")
        if self.topics.is_internal(asked):
            raise WireError(ErrorCode.INVALID_REQUEST, f"reply_to {asked!r} is one of the pipeline's own topics; "
                            f"answers go to {self.topics.results!r} or a reply topic of yours", "reply_to")
        if asked != self.default(tenant) and not await self.topic_exists(asked):
            raise WireError(ErrorCode.INVALID_REQUEST, f"reply_to topic {asked!r} does not exist; create it first",
                            "reply_to")
        return asked


class TopicCache:
    """Which topics exist, from cluster metadata, cached for ``ttl_s`` (monotonic)."""

    def __init__(self, bootstrap: str, ttl_s: float, client_kwargs: dict[str, Any] | None = None) -> None:
        self.bootstrap = bootstrap
        self.ttl_s = ttl_s
        self.client_kwargs = client_kwargs or {}
        self._known: set[str] = set()
        self._fetched_at = float("-inf")
        self._admin: Any = None

    async def exists(self, topic: str) -> bool:
        if topic in self._known:
            return True
        if time.monotonic() - self._fetched_at >= self.ttl_s:
            if self._admin is None:
                admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, **self.client_kwargs)
                try:
                    await admin.start()
                except BaseException:  # the broker away: closed, and a fresh client tried next time
                    with contextlib.suppress(Exception):
                        await admin.close()
                    raise
                self._admin = admin
            self._known = set(await self._admin.list_topics())
            self._fetched_at = time.monotonic()
        return topic in self._known
