"""The Kafka client's own CPU per record: a stage-like relay (consume a record, produce one,
commit every 200 ms, an idempotent producer with acks=all, linger 0) with aiokafka (what the
stages run) and with confluent-kafka (librdkafka), fed at a paced rate by a separate process in
bursts of three records (a request's). Not part of the project: confluent-kafka is no
dependency of it. docs/capacity.md ("The Kafka client's own cost per record") has the numbers.

    python -m venv /tmp/ckvenv && /tmp/ckvenv/bin/pip install confluent-kafka aiokafka==0.14.0
    mmstream up   # or the broker alone
    /tmp/ckvenv/bin/python docs/capacity/kafka_client_relay.py aiokafka|confluent RATE SECONDS

``WAIT`` and ``MINB`` in the environment set the aiokafka consumer's fetch_max_wait_ms and
fetch_min_bytes (500 and 1, the stages' settings, by default)."""
import asyncio, os, resource, sys, time, uuid

BOOT = "127.0.0.1:9092"
impl, rate, secs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
run = uuid.uuid4().hex[:8]
SRC, DST = f"ckb.src.{run}", f"ckb.dst.{run}"
PAYLOAD = os.urandom(300)
N = int(rate * secs)


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_topics():
    from confluent_kafka.admin import AdminClient, NewTopic
    a = AdminClient({"bootstrap.servers": BOOT})
    for f in a.create_topics([NewTopic(t, 4, 1) for t in (SRC, DST)]).values():
        f.result()


def feeder():
    """A separate process produces N records to SRC at RATE, in bursts of 3 (a request's records)."""
    import subprocess
    code = f"""
import time, os
from confluent_kafka import Producer
p = Producer({{'bootstrap.servers': '{BOOT}', 'linger.ms': 0}})
start = time.time(); payload = os.urandom(300)
for i in range(0, {N}, 3):
    t = start + i / {rate}
    d = t - time.time()
    if d > 0: time.sleep(d)
    for j in range(3): p.produce('{SRC}', payload, key=str(i+j).encode())
    p.poll(0)
p.flush()
"""
    return subprocess.Popen([sys.executable, "-c", code])


async def relay_aiokafka():
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    c = AIOKafkaConsumer(SRC, bootstrap_servers=BOOT, group_id=f"g{run}", enable_auto_commit=False,
                         auto_offset_reset="earliest", fetch_max_wait_ms=int(os.environ.get("WAIT", "500")), fetch_min_bytes=int(os.environ.get("MINB", "1")))
    p = AIOKafkaProducer(bootstrap_servers=BOOT, acks="all", enable_idempotence=True, linger_ms=0)
    await c.start(); await p.start()
    done, t0, c0, last_commit = 0, None, None, time.time()
    while done < N:
        batch = await c.getmany(timeout_ms=1000, max_records=500)
        for tp, recs in batch.items():
            if t0 is None:
                t0, c0 = time.time(), cpu()
            for r in recs:
                await p.send(DST, r.value, key=r.key)  # enqueued; the delivery is not awaited, as the stages do
            done += len(recs)
        if time.time() - last_commit > 0.2:  # the stages commit every 200 ms
            await c.commit(); last_commit = time.time()
    await p.flush()
    used = cpu() - c0
    await c.stop(); await p.stop()
    return used, time.time() - t0


def relay_confluent():
    from confluent_kafka import Consumer, Producer
    c = Consumer({"bootstrap.servers": BOOT, "group.id": f"g{run}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "fetch.wait.max.ms": 500})
    p = Producer({"bootstrap.servers": BOOT, "acks": "all", "enable.idempotence": True, "linger.ms": 0})
    c.subscribe([SRC])
    done, t0, c0, last_commit = 0, None, None, time.time()
    while done < N:
        msgs = c.consume(num_messages=500, timeout=1.0)
        if not msgs:
            continue
        if t0 is None:
            t0, c0 = time.time(), cpu()
        for m in msgs:
            p.produce(DST, m.value(), key=m.key())
        p.poll(0)
        done += len(msgs)
        if time.time() - last_commit > 0.2:
            c.commit(asynchronous=True); last_commit = time.time()
    p.flush()
    used = cpu() - c0
    c.close()
    return used, time.time() - t0


make_topics()
f = feeder()
used, wall = asyncio.run(relay_aiokafka()) if impl == "aiokafka" else relay_confluent()
f.wait()
print(f"{impl}: {N} records at {rate}/s: relay CPU {used:.2f} s over {wall:.1f} s = {used / N * 1e6:.0f} us per record")
