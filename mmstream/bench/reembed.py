"""A text model change under query load: what the background re-embed costs and what the
queries see meanwhile (issue 23).

    python -m mmstream.bench.reembed --docs 5000 --rate 20 --seed 3 [--out run.json]

On a pipeline of its own (router, assembler, encode.text, index, retrieve) over a model
repository of links to the built one (``linked_repository``), it fills one collection with
``--docs`` corpus passages, then, with retrieve requests arriving open loop at ``--rate``
throughout:

1. adds the text model's newest version again as the next version (``alias_version``: the
   same weights under another identity, which is all the pipeline can tell of a model
   change) and restarts the index stage, which re-embeds the collection into the new space;
2. waits until the vectors topic holds the new space's ready marker for every partition;
   (the reuse cache's entries of that identity, left by an earlier run, are deleted first:
   the re-embed runs cold);
3. restarts the stages that encode queries (``encode.text``, and the router, which runs a
   text encoder of its own), so that queries come in the new space;
4. goes on for ``--after`` seconds.

Reported per phase (before the change, during the re-embed, while the encoders roll, after):
requests, answers by the space that gave them, errors by code, e2e percentiles; and the
re-embed's seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack

from mmstream.stats import summary
from mmstream.supervisor import Supervisor
from schemas.documents import READY_PREFIX
from schemas.request import Lane, Modality, Params, Part, Request, Task
from schemas.settings import Settings
from schemas.topics import TopicNames
from streams.observe.topic_reader import read_to_end
from streams.runtime.parent import PARENT_PID_ENV
from streams.sdk.client import Client, new_id, wait_until_serving
from streams.topics import collection_spec, ensure_topics, topic_specs
from workers.retrieval import corpus as C

TEXT_MODEL = "all-minilm-l6-v2"
COLLECTION = "kb"
STAGES = {"router": 1, "assembler": 1, "encode.text": 1, "index": 1, "retrieve": 1}


def linked_repository(source: Path, into: Path) -> Path:
    """A model repository of links to ``source``'s built models: a version can be added to it
    without touching ``source``."""
    into.mkdir(parents=True)
    for model in source.iterdir():
        if model.is_dir():
            (into / model.name).mkdir()
            for version in model.iterdir():
                (into / model.name / version.name).symlink_to(version.resolve(), target_is_directory=True)
    return into


def alias_version(repo: Path, name: str) -> str:
    """The newest version of ``name`` again as the next version number (its files linked, its
    config saying the new number); returns that number."""
    versions = sorted(int(v.name) for v in (repo / name).iterdir() if v.name.isdigit())
    old, new = repo / name / str(versions[-1]), repo / name / str(versions[-1] + 1)
    new.mkdir()
    for f in old.iterdir():
        if f.name != "config.json":
            (new / f.name).symlink_to(f.resolve())
    config = json.loads((old / "config.json").read_text())
    config["version"] = str(versions[-1] + 1)
    (new / "config.json").write_text(json.dumps(config))
    return config["version"]


async def ready_spaces(bootstrap: str, vectors: str, collection: str = COLLECTION) -> dict[str, set[int]]:
    """Model identity -> the partitions of ``collection`` its ready markers name."""
    out: dict[str, set[int]] = {}
    for r in await read_to_end(bootstrap, vectors):
        try:
            _, name, model, doc = msgpack.unpackb(r.key, raw=False)
        except Exception:  # noqa: BLE001 - not a key of ours
            continue
        if name == collection and doc.startswith(READY_PREFIX) and r.value is not None:
            out.setdefault(model, set()).add(int(doc[len(READY_PREFIX):]))
    return out


class Traffic:
    """Retrieve requests open loop at ``rate``; each answer noted with the phase it was sent in."""

    def __init__(self, client: Client, queries: list[str], rate: float, seed: int) -> None:
        self.client, self.queries, self.rate = client, queries, rate
        self.rng = random.Random(seed)
        self.phase = "before"
        self.rows: list[dict[str, Any]] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        tasks = []
        while not self.stop.is_set():
            tasks.append(asyncio.create_task(self._one(self.phase)))
            await asyncio.sleep(self.rng.expovariate(self.rate))
        await asyncio.gather(*tasks)

    async def _one(self, phase: str) -> None:
        sent = time.monotonic()
        req = Request(id=new_id(), parts=(Part(Modality.TEXT, text=self.rng.choice(self.queries)),),
                      task=Task.RETRIEVE, params=Params(collection=COLLECTION, k=10), lane=Lane.RT,
                      deadline_ms=30_000)
        row: dict[str, Any] = {"phase": phase}
        try:
            ev = await (await self.client.submit(req)).result(timeout_s=40)
            row["ms"] = (time.monotonic() - sent) * 1000
            row["outcome"] = ((ev.payload or {}).get("index") or {}).get("model", "?") if ev.kind == "result" \
                else f"error:{(ev.error or {}).get('code')}"
        except Exception as exc:  # noqa: BLE001 - counted, never raised
            row["outcome"] = f"no answer: {type(exc).__name__}"
        self.rows.append(row)


def _drop_cached(url: str, version: str) -> int:
    """Delete the reuse cache's entries of the new version (an earlier run made the same
    identity): the re-embed is measured cold, every passage through the engine."""
    import redis

    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=f"mm:enc:*|text|{TEXT_MODEL}|{version}|*", count=10_000))
    for i in range(0, len(keys), 1000):
        r.delete(*keys[i:i + 1000])
    return len(keys)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: requests, answers by the space that gave them (or error code), e2e ms."""
    out: dict[str, Any] = {}
    for phase in ("before", "re-embed", "roll", "after"):
        mine = [r for r in rows if r["phase"] == phase]
        out[phase] = {"requests": len(mine), "outcomes": dict(Counter(r["outcome"] for r in mine)),
                      "e2e_ms": summary(r["ms"] for r in mine if "ms" in r)}
    return out


async def run(docs: int, rate: float, seed: int, after_s: float) -> dict[str, Any]:
    base = Settings.from_env()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"reembed-{uuid.uuid4().hex[:8]}"
    repo = linked_repository(Path(base.models.repository), work / "models")
    env = {**os.environ, "MMSTREAM_KAFKA_TOPIC_PREFIX": f"reembed{uuid.uuid4().hex[:8]}",
           "MMSTREAM_MODELS_REPOSITORY": str(repo), "MMSTREAM_LOCAL_METRICS_BASE_PORT": "0",
           "MMSTREAM_ROUTER_SERVED_MODALITIES": "text", "MMSTREAM_ROUTER_TOPIC_CACHE_S": "1",
           "MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT": "5000", PARENT_PID_ENV: str(os.getpid())}
    s = Settings.from_env(env)
    k, names = s.kafka, TopicNames(s.kafka.topic_prefix)
    await ensure_topics(k.bootstrap, [*topic_specs(k, s.dlq), collection_spec(k, "default", COLLECTION)])
    sup = Supervisor(s, env)
    await asyncio.to_thread(sup.start, STAGES)
    passages = C.load_corpus(limit=docs + 500)
    report: dict[str, Any] = {"docs": docs, "rate": rate, "seed": seed}
    try:
        await wait_until_serving(k.bootstrap, k.topic_prefix, 180)
        async with Client(k.bootstrap, k.topic_prefix) as client:
            started = time.monotonic()
            for i in range(0, docs, 500):
                await asyncio.gather(*(client.put_document(COLLECTION, p.id, p.text, p.meta)
                                       for p in passages[i:min(i + 500, docs)]))
            partitions = k.partitions  # the collection topic's (collection_spec's default)
            while True:  # every document searchable (a ready marker only says "caught up once")
                ev = await (await client.retrieve(COLLECTION, "probe", k=1, deadline_ms=30_000)).result(timeout_s=60)
                if ((ev.payload or {}).get("index") or {}).get("documents", 0) >= docs:
                    break
                await asyncio.sleep(1)
            report["first_index_s"] = round(time.monotonic() - started, 1)
            traffic = Traffic(client, [C.query_of(p, random.Random(i)) for i, p in enumerate(passages[docs:])],
                              rate, seed)
            sending = asyncio.create_task(traffic.run())
            await asyncio.sleep(10)
            version = alias_version(repo, TEXT_MODEL)
            report["cache_entries_dropped"] = await asyncio.to_thread(_drop_cached, s.redis.url, version)
            traffic.phase, changed = "re-embed", time.monotonic()
            await asyncio.to_thread(sup.stop_one, next(w for w in sup.workers() if w.stage == "index" and w.alive))
            await asyncio.to_thread(sup.start, {"index": 1})
            while True:
                ready = await ready_spaces(k.bootstrap, names.vectors)
                new = [m for m, ps in ready.items() if f"/{version}/" in m and len(ps) >= partitions]
                if new:
                    break
                await asyncio.sleep(2)
            report["reembed_s"] = round(time.monotonic() - changed, 1)
            traffic.phase, rolled = "roll", time.monotonic()
            for stage in ("encode.text", "router"):
                await asyncio.to_thread(sup.stop_one, next(w for w in sup.workers() if w.stage == stage and w.alive))
                await asyncio.to_thread(sup.start, {stage: 1})
            report["roll_s"] = round(time.monotonic() - rolled, 1)
            traffic.phase = "after"
            await asyncio.sleep(after_s)
            traffic.stop.set()
            await sending
        report["phases"] = summarize(traffic.rows)
        report["new_space"] = new[0]
        return report
    finally:
        await asyncio.to_thread(sup.stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmstream.bench.reembed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--after", type=float, default=20.0, help="seconds of traffic after the roll")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    report = asyncio.run(run(a.docs, a.rate, a.seed, a.after))
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    print(json.dumps({p: {"requests": v["requests"], "outcomes": v["outcomes"], "p95": v["e2e_ms"].get("p95")}
                      for p, v in report["phases"].items()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
