"""What Kafka transactions would cost the answering stages: `python -m mmstream.chaos.txcost`.

Measures, on the configured broker and a topic of its own, the time from handing an answer
(its event plus its done marker) to the producer until a reader sees it, two ways:

- today: idempotent producer, ``acks=all``, the answer awaited; a read_uncommitted reader;
- transactions: begin, the same two records, ``send_offsets_to_transaction`` (the input's
  offset, as the stage would commit it), commit; a read_committed reader.

``--gap-ms`` idles that long between answers, as a lightly loaded pipeline does (10 req/s: about
100 ms): on a small VM every wake-up of the producer, the broker and the reader then costs more
than back to back, and that is the hop a light-load request pays (docs/capacity.md).

One answer per transaction is the latency floor for a stage that answers as work finishes
(a generator's step, an assembler's fan-in); batching answers into fewer transactions
lowers the cost per answer and adds up to the batching window to each answer's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmstream.chaos.checks import p99
from schemas.settings import Settings
from streams.connection import client_kwargs


async def measure(bootstrap: str, n: int = 200, security: dict[str, Any] | None = None, gap_s: float = 0.0,
                  modes: tuple[str, ...] = ("idempotent", "transactional")) -> dict[str, dict[str, float]]:
    topic = f"txcost-{uuid.uuid4().hex[:8]}"
    sec = dict(security or {})
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **sec)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 1)])
    await admin.close()
    out = {}
    for mode in modes:
        out[mode] = await _one(bootstrap, topic, mode, n, sec, gap_s)
    return out


async def _one(bootstrap: str, topic: str, mode: str, n: int, sec: dict[str, Any], gap_s: float) -> dict[str, float]:
    tx = mode == "transactional"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0,
                                transactional_id=f"txcost-{uuid.uuid4().hex[:8]}" if tx else None, **sec)
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                              isolation_level="read_committed" if tx else "read_uncommitted", fetch_max_wait_ms=10,
                              **sec)
    await producer.start()
    await reader.start()
    tp = TopicPartition(topic, 0)
    reader.assign([tp])
    await reader.seek_to_end(tp)
    send_ms, seen_ms = [], []
    try:
        for i in range(n):
            key = f"{mode}-{i}".encode()
            t0 = time.perf_counter()
            if tx:
                async with producer.transaction():
                    await producer.send(topic, b"event", key=key)
                    await producer.send(topic, b"marker", key=key)
                    await producer.send_offsets_to_transaction({tp: i + 1}, "txcost-group")
            else:
                futures = [await producer.send(topic, b"event", key=key), await producer.send(topic, b"marker", key=key)]
                await asyncio.gather(*futures)
            t1 = time.perf_counter()
            while True:
                records = [r for rs in (await reader.getmany(timeout_ms=1000)).values() for r in rs]
                if any(r.key == key and r.value == b"marker" for r in records):
                    break
            t2 = time.perf_counter()
            send_ms.append((t1 - t0) * 1000)
            seen_ms.append((t2 - t0) * 1000)
            if gap_s:
                await asyncio.sleep(gap_s)
    finally:
        await producer.stop()
        await reader.stop()
    return {"send_p50_ms": round(sorted(send_ms)[len(send_ms) // 2], 2), "send_p99_ms": round(p99(send_ms) or 0, 2),
            "seen_p50_ms": round(sorted(seen_ms)[len(seen_ms) // 2], 2), "seen_p99_ms": round(p99(seen_ms) or 0, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmstream.chaos.txcost", description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="answers per mode (default: 200)")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="idle time between answers (default: 0)")
    parser.add_argument("--plain-only", action="store_true", help="only the idempotent producer (one plain hop)")
    args = parser.parse_args(argv)
    if args.n < 1 or args.gap_ms < 0:
        parser.error("-n must be at least 1 and --gap-ms at least 0")
    settings = Settings.from_env()
    modes = ("idempotent",) if args.plain_only else ("idempotent", "transactional")
    result = asyncio.run(measure(settings.kafka.bootstrap, args.n, client_kwargs(settings), args.gap_ms / 1000.0, modes))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
