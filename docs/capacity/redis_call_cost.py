"""Client CPU of one reuse-cache call, alone (docs/capacity.md, "Stop 57").

The encoder cache's two calls per batch (``lookup_or_claim`` and ``set_many``, one key each),
a plain ``GET`` and a ``PING``, 3,000 of each in a row against the local Redis of `mmstream
up`; prints wall and CPU (user + system of this process) per call.

    $ mmstream up
    $ PYTHONPATH=. .venv/bin/python docs/capacity/redis_call_cost.py [redis-url]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from workers.cache import EncoderCache, pack_output
from workers.redisconn import connect

N = 3000


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main(url: str) -> None:
    client = connect(url)
    cache = EncoderCache(url, ttl_s=60)
    value = pack_output(np.random.rand(384).astype(np.float32), {}, "float16")  # a text embedding's size
    prefix = f"costprobe:{os.getpid()}"
    calls = [
        ("lookup_or_claim, 1 key", lambda i: cache.lookup_or_claim([f"{prefix}:{i}"], 2000)),
        ("set_many, 1 item", lambda i: cache.set_many([(f"{prefix}:{i}", value)])),
        ("GET", lambda i: client.get(f"{prefix}:{i}")),
        ("PING", lambda i: client.ping()),
    ]
    for name, call in calls:
        wall0, cpu0 = time.perf_counter(), cpu_s()
        for i in range(N):
            call(i)
        wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
        print(f"{name:24s} wall {1e6 * wall / N:6.0f} µs  cpu {1e6 * cpu / N:6.0f} µs per call")
    for i in range(0, N, 500):  # leave nothing behind (the keys expire in a minute anyway)
        client.delete(*[k for j in range(i, min(N, i + 500)) for k in (f"{prefix}:{j}", f"{prefix}:{j}:inflight")])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0")
