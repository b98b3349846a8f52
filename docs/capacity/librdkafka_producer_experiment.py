"""An experiment, not part of the pipeline: librdkafka's producer (confluent-kafka) under the
stages' ``StageIO``, to measure what the Kafka client's produce side costs them
(docs/capacity.md, "librdkafka's producer under the stages: no gain").

How it was run (stop 42): in a worktree, ``StageIO._new_producer`` (streams/runtime/io.py)
returned ``RdProducer(s.bootstrap, s.max_message_bytes, f"{s.group_id}-producer")`` when
``RD_PRODUCER=1``; confluent-kafka 2.16.1 was installed apart
(``pip install --no-deps --target /tmp/ck confluent-kafka==2.16.1``) and the bench started
from the worktree with ``RD_PRODUCER=1 PYTHONPATH=<worktree>:/tmp/ck``. It has no lease fence
(``fence.py`` hooks aiokafka's accumulator) and no TLS: a measurement, not a port.

Delivery reports come back on one polling thread and reach the event loop in one call per
``poll`` (not one wake-up per record).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import confluent_kafka


class RdProducer:
    """What ``StageIO`` needs of a producer: ``await send(...)`` returns a future that resolves
    when the broker has the record (``acks=all``, idempotent), and ``stop()``."""

    def __init__(self, bootstrap: str, max_bytes: int, client_id: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.producer = confluent_kafka.Producer({
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 0,
            # the Java client's (and aiokafka's) partitioner: a key lands where the other stages put it
            "partitioner": "murmur2_random", "message.max.bytes": max_bytes, "client.id": client_id})
        self.reports: list[tuple[asyncio.Future, Any]] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._poll, daemon=True, name=f"rd-{client_id}")
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopping:
            self.producer.poll(0.1)  # delivery callbacks run here, on this thread
            batch, self.reports = self.reports, []
            if batch:
                self.loop.call_soon_threadsafe(self._resolve, batch)

    @staticmethod
    def _resolve(batch: list[tuple[asyncio.Future, Any]]) -> None:
        for fut, err in batch:
            if not fut.done():
                fut.set_result(None) if err is None else fut.set_exception(RuntimeError(str(err)))

    async def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        fut = self.loop.create_future()
        extra = {} if partition is None else {"partition": partition}
        self.producer.produce(topic, value, key, headers=headers,
                              on_delivery=lambda err, _msg: self.reports.append((fut, err)), **extra)
        return fut

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.get_running_loop().run_in_executor(None, self.producer.flush, 5)
