"""Where a lightly loaded text embed's milliseconds go between the client and the stages:
one request at a time (closed loop, RATE a second), each timed at the client (send until the
broker acknowledged, send until the answer was read) and by the records' own timestamps: the
request record's, which the router's ``route`` span counts its queue time from, and the answer
record's, read here off the reply topic. docs/capacity.md ("Stop 49") has the numbers.

    mmstream up
    .venv/bin/python docs/capacity/hop_probe.py 10 150               # CreateTime: when send() was called
    .venv/bin/python docs/capacity/hop_probe.py 10 150 --append-time # LogAppendTime: when the broker wrote it

``--append-time`` switches the ingress rt topic and the shared reply topic to the broker's
append time for the run (and back after it), which splits each hop into the producer's side
(send() until the broker wrote it) and the consumer's (written until read). Plaintext
``mmstream up`` only: it alters topic configs as the admin, and other clients of those topics
read append times while it runs."""
import asyncio
import statistics
import sys
import time

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from schemas.request import Modality, Part, Request
from schemas.settings import Settings
from streams.sdk import transport
from streams.sdk.client import Client, new_id

WORDS = ("alpha", "beta", "gamma", "delta", "stream", "kafka", "embedding", "router")
read_at: dict[bytes, tuple[float, float]] = {}


class StampedTransport(transport.KafkaTransport):
    """The SDK's transport, keeping each reply record's timestamp and when it was read."""

    async def records(self):
        async for r in self._consumer:
            read_at[r.key] = (float(r.timestamp), time.time() * 1000.0)
            yield r.key, r.value


async def set_timestamp_type(bootstrap: str, topics: list[str], kind: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, t, {"message.timestamp.type": kind})
                                   for t in topics])
    finally:
        await admin.close()


async def probe(client: Client, rate: float, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        rid = f"hop-{new_id()}"
        text = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)) + f" {rid}"  # no cache hits
        t0 = time.time() * 1000.0
        sub = await client.submit(Request(id=rid, parts=(Part(Modality.TEXT, text=text),), deadline_ms=10_000))
        acked = time.time() * 1000.0
        event = await sub.result(10)
        stamp, read = read_at.pop(rid.encode(), (None, None))
        stages = (event.timings or {}).get("stages", [])
        rows.append({"acked": acked - t0, "answered": sub.terminal_at_ms - t0, "stages": stages,
                     "to_answer_stamp": stamp - t0 if stamp else None,
                     "answer_stamp_to_read": read - stamp if stamp else None,
                     "stages_sum": sum(s["queued_ms"] + s["service_ms"] for s in stages)})
        await asyncio.sleep(1.0 / rate)
    return rows


def report(rows: list[dict]) -> None:
    def p50(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 2) if xs else None
    print(f"requests {len(rows)} (p50 ms)")
    for k in ("acked", "answered", "stages_sum", "to_answer_stamp", "answer_stamp_to_read"):
        print(f"  {k:22s} {p50([r[k] for r in rows])}")
    for name in sorted({s["stage"] for r in rows for s in r["stages"]}):
        spans = [s for r in rows for s in r["stages"] if s["stage"] == name]
        print(f"  {name:22s} queued {p50([s['queued_ms'] for s in spans])} service {p50([s['service_ms'] for s in spans])}")


async def main(rate: float, n: int, append_time: bool) -> None:
    s = Settings.from_env()
    client = Client(s.kafka.bootstrap, s.kafka.topic_prefix)
    client._transport = StampedTransport(s.kafka.bootstrap)
    topics = [client.reply_to, client.ingress("rt")]
    if append_time:
        await set_timestamp_type(s.kafka.bootstrap, topics, "LogAppendTime")
    try:
        async with client:
            report(await probe(client, rate, n))
    finally:
        if append_time:
            await set_timestamp_type(s.kafka.bootstrap, topics, "CreateTime")


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), int(sys.argv[2]), "--append-time" in sys.argv[3:]))
