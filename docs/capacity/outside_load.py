"""An outside load generator, not part of the pipeline: librdkafka (confluent-kafka) and
msgpack only, no mmstream code. It produces the capacity mix's shape (60% texts of 1, 4 or 15
sentences, 40% JPEG photos of 256-1024 px, each unique, so the reuse cache never hits) to
``<prefix>.ingress.rt`` at a fixed rate, open loop, reads ``<prefix>.results``, and reports the
terminal events by code, the e2e percentiles of results by modality (from its own produce call
to the terminal event it read), and how many ``overloaded`` came without ``retry_after_ms``.

How it was run (stop 54, docs/capacity.md), on a fresh ``mmstream up`` (plaintext, prefix mm):

    python docs/capacity/outside_load.py 127.0.0.1:9092 mm 180 20 25   # rate, seconds, drain
"""
import io, random, sys, time, uuid
import msgpack
from confluent_kafka import Consumer, Producer, TopicPartition
from PIL import Image

bootstrap, prefix, rate, duration, drain = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
rng = random.Random(11)
WORDS = "the of and to in is that for it as was with be by on not he this are or his from at which but have".split()

def sentence(i):
    return " ".join(rng.choice(WORDS) for _ in range(12)) + f" {i}."

n = int(rate * duration)
photos = []
for i in range(int(n * 0.5) + 20):
    side = rng.choice((256, 512, 768, 1024))
    small = Image.frombytes("RGB", (32, 32), bytes(rng.getrandbits(8) for _ in range(32 * 32 * 3)))
    buf = io.BytesIO(); small.resize((side, side), Image.BILINEAR).save(buf, "JPEG", quality=85)
    photos.append(buf.getvalue())
print(f"{len(photos)} photos ready", flush=True)

p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1, "acks": "all"})
c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"outside-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False})
results = f"{prefix}.results"
md = c.list_topics(results, timeout=10)
tps = [TopicPartition(results, q) for q in md.topics[results].partitions]
ends = [c.get_watermark_offsets(tp, timeout=10)[1] for tp in tps]
c.assign([TopicPartition(results, tp.partition, e) for tp, e in zip(tps, ends)])

sent, done, kinds = {}, {}, {}
def poll(t):
    for m in c.consume(500, t):
        if m.error() or m.value() is None:
            continue
        ev = msgpack.unpackb(m.value(), raw=False, strict_map_key=False)
        rid = ev.get("id")
        if rid in sent and rid not in done and ev.get("kind") in ("result", "error"):
            done[rid] = (time.monotonic(), ev.get("kind"), ev.get("error") or {})

start = time.monotonic()
photo_i = 0
for i in range(n):
    due = start + i / rate
    while time.monotonic() < due:
        poll(max(0.0, min(0.005, due - time.monotonic())))
    rid = uuid.uuid4().hex
    if rng.random() < 0.6:
        part = {"modality": "text", "text": " ".join(sentence(i * 100 + k) for k in range(rng.choice((1, 4, 15))))}
        mod = "text"
    else:
        part = {"modality": "image", "data": photos[photo_i], "mime": "image/jpeg"}; photo_i += 1
        mod = "image"
    body = msgpack.packb({"v": 1, "id": rid, "task": "embed", "lane": "rt", "deadline_ms": 10_000, "parts": [part]}, use_bin_type=True)
    sent[rid] = (time.monotonic(), mod)
    p.produce(f"{prefix}.ingress.rt", body, key=rid.encode(), headers=[("content-type", b"application/msgpack")])
    p.poll(0)
p.flush(10)
print(f"offered {n} in {time.monotonic() - start:.1f} s", flush=True)
end = time.monotonic() + drain
while time.monotonic() < end and len(done) < len(sent):
    poll(0.2)
codes, lat, no_retry = {}, {"text": [], "image": []}, 0
for rid, (t0, mod) in sent.items():
    if rid not in done:
        codes["lost"] = codes.get("lost", 0) + 1; continue
    t1, kind, err = done[rid]
    code = "ok" if kind == "result" else err.get("code", "?")
    codes[code] = codes.get(code, 0) + 1
    if kind == "result":
        lat[mod].append((t1 - t0) * 1000)
    elif code == "overloaded" and not err.get("retry_after_ms"):
        no_retry += 1
def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
print("codes", codes, "overloaded without retry_after_ms:", no_retry)
for mod, xs in lat.items():
    print(f"{mod}: n {len(xs)} p50 {pct(xs, .5):.0f} p95 {pct(xs, .95):.0f} p99 {pct(xs, .99):.0f} ms")
