"""What the Kafka-native shape alone costs per request: the floor under issue 26's CPU bound
(docs/capacity.md, "Stop 58").

Three processes and the broker, nothing else: a client that sends the capacity mix's request
records (the bench's own bytes) at a Poisson rate with the SDK's producer settings and reads
its answers; a relay that does what the answering stage does per request and nothing more
(consume with the stages' fetch settings, produce a 1 KiB answer with their idempotent,
``acks=all`` producer, commit every 200 ms); the local broker of `mmstream up`. No routing,
no engine, no cache. Prints the relay's and the broker's CPU per request (the pipeline's
``per_process_s`` counts both; the client's is the user's) and the client's round trip.

    $ mmstream up   # then stop its workers: only the broker is measured
    $ PYTHONPATH=. .venv/bin/python docs/capacity/kafka_floor.py [RATE] [SECONDS]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmstream import localstack
from mmstream.bench.workloads import arrival_offsets, capacity_request
from mmstream.supervisor import proc_cpu_s
from schemas.codec import pack
from schemas.settings import Settings

ANSWER = os.urandom(1024)  # a text embedding's answer event, about
REPO = Path(__file__).resolve().parents[2]


async def relay(boot: str, src: str, dst: str, ready: "multiprocessing.Event") -> None:
    consumer = AIOKafkaConsumer(src, bootstrap_servers=boot, group_id=f"floor-{src}", enable_auto_commit=False,
                                auto_offset_reset="earliest", fetch_max_wait_ms=500, max_poll_records=500,
                                metadata_max_age_ms=5000)  # the stages' (streams/runtime/io.py)
    producer = AIOKafkaProducer(bootstrap_servers=boot, acks="all", enable_idempotence=True, linger_ms=0,
                                metadata_max_age_ms=5000)
    await consumer.start()
    await producer.start()
    ready.set()
    last_commit, moved = time.monotonic(), False
    while True:
        batch = await consumer.getmany(timeout_ms=1000, max_records=500)
        sent = [await producer.send(dst, ANSWER, key=r.key) for recs in batch.values() for r in recs]
        if sent:
            await asyncio.gather(*sent)  # the stages finish a record once its outputs are with the broker
            moved = True
        if moved and time.monotonic() - last_commit > 0.2:  # as StageIO: every 200 ms, when something moved
            await consumer.commit()
            last_commit, moved = time.monotonic(), False


def relay_main(boot: str, src: str, dst: str, ready: "multiprocessing.Event") -> None:
    asyncio.run(relay(boot, src, dst, ready))


async def client(boot: str, src: str, dst: str, rate: float, seconds: float,
                 mark: Callable[[], None]) -> list[float]:
    """Sends the schedule and reads every answer; ``mark`` is called when the clients are ready
    and the records built, and again when the last answer is in (the CPU window)."""
    rng = random.Random(7)
    offsets = arrival_offsets(rate, seconds, rng)
    records = [pack(capacity_request(rng, "rt").to_wire()) for _ in offsets]
    producer = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=0, acks=1, max_request_size=8 << 20)
    reader = AIOKafkaConsumer(dst, bootstrap_servers=boot, enable_auto_commit=False, fetch_max_wait_ms=500,
                              auto_offset_reset="latest")
    await producer.start()
    await reader.start()
    await reader.seek_to_end()
    sent_at: dict[bytes, float] = {}
    took: list[float] = []

    async def read() -> None:
        while len(took) < len(records):
            for recs in (await reader.getmany(timeout_ms=1000)).values():
                for r in recs:
                    took.append((time.monotonic() - sent_at.pop(r.key)) * 1000.0)

    try:
        reading = asyncio.ensure_future(read())
        mark()
        start = time.monotonic()
        for i, (at, value) in enumerate(zip(offsets, records)):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            key = str(i).encode()
            sent_at[key] = time.monotonic()
            await producer.send_and_wait(src, value, key=key)
        await asyncio.wait_for(reading, timeout=30)
        mark()
    finally:
        await producer.stop()
        await reader.stop()
    return took


async def topics(boot: str, names: list[str], partitions: int, create: bool) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=boot)
    await admin.start()
    try:
        if create:
            await admin.create_topics([NewTopic(t, partitions, 1) for t in names])
        else:
            await admin.delete_topics(names)
    finally:
        await admin.close()


def workers_running() -> bool:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"mmstream.cli\0worker" in f.read():
                    return True
        except (OSError, ValueError):
            continue
    return False


def main(rate: float, seconds: float) -> None:
    settings = Settings()
    boot = settings.kafka.bootstrap
    broker = localstack.status(settings, REPO)[0].pid
    if broker is None:
        sys.exit("no local broker: run `mmstream up` first (only its broker's CPU can be read here)")
    if workers_running():
        sys.exit("pipeline workers are running: stop them (their idle requests would be charged to the floor)")
    run = uuid.uuid4().hex[:8]
    src, dst = f"floor.{run}.in", f"floor.{run}.out"
    asyncio.run(topics(boot, [src, dst], settings.kafka.partitions, create=True))
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    worker = ctx.Process(target=relay_main, args=(boot, src, dst, ready), daemon=True)
    worker.start()
    try:
        if not ready.wait(60):
            sys.exit("the relay did not start within 60 s")
        time.sleep(5)  # the relay's group settles
        marks: list[tuple[float, float, float]] = []
        took = asyncio.run(client(boot, src, dst, rate, seconds,
                                  lambda: marks.append((proc_cpu_s(broker), proc_cpu_s(worker.pid), time.monotonic()))))
    finally:
        worker.terminate()
        asyncio.run(topics(boot, [src, dst], 0, create=False))
    (b0, r0, t0), (b1, r1, t1) = marks
    n = len(took)
    took.sort()
    print(f"{n} requests at {rate:g}/s over {t1 - t0:.1f} s: broker {(b1 - b0) / n * 1000:.2f} ms, relay "
          f"{(r1 - r0) / n * 1000:.2f} ms of CPU per request; round trip p50 {took[n // 2]:.1f} ms, "
          f"p99 {took[int(n * 0.99)]:.1f} ms")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 90.0, float(sys.argv[2]) if len(sys.argv) > 2 else 30.0)
