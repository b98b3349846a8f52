"""How the SDK reaches the pipeline: produce request records, receive reply-topic records.

``Client`` talks to a ``Transport``; ``KafkaTransport`` is the real one (aiokafka). Unit
tests give the client a fake transport that answers like the pipeline would, so the SDK's
own logic (deduplication, retries, claim checks) is tested without a broker.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Protocol


class TransportError(RuntimeError):
    """The transport could not connect or send; the message says what to check."""


class Transport(Protocol):
    async def start(self, reply_to: str) -> None:
        """Connect, and start receiving every record written to ``reply_to`` from now on.

        Raises ``TransportError`` when the broker cannot be reached or the topic is missing."""

    async def send(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        """Write one record and wait for the broker's acknowledgement."""

    def records(self) -> AsyncIterator[tuple[bytes | None, bytes]]:
        """(key, value) of each reply-topic record, in arrival order, until closed."""

    async def close(self) -> None:
        """Release every connection; safe after a failed ``start`` and when called twice."""


class KafkaTransport:
    """One aiokafka producer, and one consumer assigned every partition of the reply topic
    (no consumer group: a tenant's principal needs READ on its reply topic and nothing else).
    ``client_kwargs``: security options (``streams.connection.KafkaSecurity.aiokafka_kwargs``)."""

    def __init__(self, bootstrap: str, max_request_bytes: int = 8 * 1024 * 1024,
                 client_kwargs: dict[str, Any] | None = None) -> None:
        self.bootstrap = bootstrap
        self.max_request_bytes = max_request_bytes
        self.client_kwargs = client_kwargs or {}
        self._producer = None
        self._consumer = None

    async def start(self, reply_to: str) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
        from aiokafka.errors import KafkaConnectionError

        try:
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=0,
                                              max_request_size=self.max_request_bytes, acks=1, **self.client_kwargs)
            await self._producer.start()
            # Replies answer a waiting fetch at once: the long wait only spares an idle client's CPU.
            self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                              fetch_max_wait_ms=500, auto_offset_reset="latest", **self.client_kwargs)
            await self._consumer.start()
            partitions = self._consumer.partitions_for_topic(reply_to)
            if partitions is None:
                await self._consumer._client.force_metadata_update()  # first contact may lack it
                partitions = self._consumer.partitions_for_topic(reply_to)
            if not partitions:
                raise TransportError(f"reply topic {reply_to} does not exist or this client may not read it: is "
                                     "the pipeline up (mmstream up), and is it your tenant's reply topic?")
            tps = [TopicPartition(reply_to, p) for p in sorted(partitions)]
            self._consumer.assign(tps)
            await self._consumer.seek_to_end(*tps)
            for tp in tps:  # resolve positions now, so no event sent after start() is missed
                await self._consumer.position(tp)
        except KafkaConnectionError:
            with contextlib.suppress(Exception):  # the original error is the one to report
                await self.close()
            raise TransportError(f"cannot reach Kafka at {self.bootstrap}: is it running? (start it with "
                                 "`mmstream up`, or point MMSTREAM_KAFKA_BOOTSTRAP at your cluster)") from None
        except BaseException:  # a failed seek, a cancelled or timed-out start: nothing is left open
            with contextlib.suppress(Exception):
                await self.close()
            raise

    async def send(self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        if self._producer is None:
            raise TransportError("transport not started")
        await self._producer.send_and_wait(topic, value, key=key, headers=headers)

    async def records(self) -> AsyncIterator[tuple[bytes | None, bytes]]:
        assert self._consumer is not None, "transport not started"
        async for record in self._consumer:
            yield record.key, record.value

    async def close(self) -> None:
        consumer, producer = self._consumer, self._producer
        self._consumer = self._producer = None
        try:
            if consumer is not None:
                await consumer.stop()
        finally:  # the producer is stopped even when the consumer's stop failed
            if producer is not None:
                await producer.stop()
