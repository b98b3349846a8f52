"""`mmstream bench --workload retrieve-images`: image search through the whole pipeline.

The collection is made of the photos that ship with scikit-image (``PHOTOS``, the bench's
photos and more), each as ``cfg.docs / len(PHOTOS)`` variants: a random crop of 55-95% of
the photo, maybe mirrored, brightness and contrast moved by up to 20%, resized to at most
480 px and saved as JPEG at quality 70-95. The queries are variants of the same kind drawn
with another seed (so no query is a document), and a ``cfg.repeat`` share re-save an earlier
query (another JPEG quality, a 2% crop): near-duplicates for the reuse cache.

Documents go through the documents topic as image documents, are embedded by the indexing
stage with the image encoder, and the queries are retrieve requests with an image part,
embedded by ``encode.image``. Reported, beside the standard run JSON: the retrieve stage's
service time, the share answered by reuse, how often the best hit is a variant of the
query's own photo (``top1_same_photo``), and recall@10 of the answers against exact search
(``recall_at_k``: documents and queries embedded again in this process with the image
encoder the pipeline serves, every document scored), each split by reused and searched.
"""

from __future__ import annotations

import asyncio
import io
import random
import sys
import time
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from mmstream.bench.config import BenchConfig
from mmstream.bench.retrieval_run import K, client_of, search_run
from mmstream.bench.workloads import arrival_offsets
from mmstream.levers import own_pipeline
from schemas.request import Lane, Modality, Params, Part, Request, Task
from schemas.settings import Settings
from streams.connection import client_kwargs
from streams.sdk.client import new_id
from streams.topics import collection_spec, ensure_topics

COLLECTION = "photos"
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina",
          "camera", "coins", "moon", "clock", "brick", "grass", "gravel", "page", "text", "colorwheel", "cell")


def source(name: str) -> Image.Image:
    from skimage import data

    a = np.asarray(getattr(data, name)())
    return Image.fromarray(a).convert("RGB")


def variant(photo: Image.Image, rng: random.Random) -> bytes:
    """One JPEG variant of ``photo`` (see the module doc)."""
    w, h = photo.size
    share = rng.uniform(0.55, 0.95)
    cw, ch = max(16, int(w * share)), max(16, int(h * share))
    x, y = rng.randrange(0, w - cw + 1), rng.randrange(0, h - ch + 1)
    img = photo.crop((x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        img = ImageOps.mirror(img)
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.8, 1.2))
    img = ImageEnhance.Contrast(img).enhance(rng.uniform(0.8, 1.2))
    img.thumbnail((480, 480))
    return _jpeg(img, rng.randrange(70, 96))


def resaved(data: bytes, rng: random.Random) -> bytes:
    """A near-duplicate of a JPEG: a 2% crop, saved at another quality."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    dx, dy = max(1, w // 50), max(1, h // 50)
    return _jpeg(img.crop((dx, dy, w - dx, h - dy)), rng.randrange(60, 96))


def _jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def documents(n: int, seed: int) -> list[tuple[str, str, bytes]]:
    """(doc id, source photo, JPEG) for ``n`` documents, round-robin over ``PHOTOS``."""
    rng = random.Random(f"{seed}:photo-docs")
    sources = {name: source(name) for name in PHOTOS}
    return [(f"{PHOTOS[i % len(PHOTOS)]}-{i:05d}", PHOTOS[i % len(PHOTOS)], variant(sources[PHOTOS[i % len(PHOTOS)]], rng))
            for i in range(n)]


def queries(n: int, seed: int, repeat: float) -> list[tuple[str, bytes]]:
    """(source photo, JPEG) for ``n`` queries; a ``repeat`` share re-saves an earlier one."""
    rng = random.Random(f"{seed}:photo-queries")
    sources = {name: source(name) for name in PHOTOS}
    out: list[tuple[str, bytes]] = []
    for _ in range(n):
        if out and rng.random() < repeat:
            name, data = rng.choice(out)
            out.append((name, resaved(data, rng)))
        else:
            name = rng.choice(PHOTOS)
            out.append((name, variant(sources[name], rng)))
    return out


async def run_image_retrieval(settings: Settings, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    docs = await asyncio.to_thread(documents, cfg.docs, cfg.seed)
    env = {"MMSTREAM_ROUTER_TOPIC_CACHE_S": "1", "MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT": "5000"}
    async with own_pipeline(settings, cfg.levers_off, "retrieve-images", extra_env=env) as s:
        await _fill(s, docs, progress)
        runs = [await _run(s, cfg, rate, progress) for rate in (cfg.rates or (cfg.rate,))]
        await asyncio.to_thread(_recall, s, docs, runs)
    return {"workload": "retrieve-images", "documents": len(docs), "photos": len(PHOTOS), "runs": runs}


def _probe(data: bytes) -> Part:
    return Part(Modality.IMAGE, data=data, mime="image/jpeg")


async def _fill(s: Settings, docs: list[tuple[str, str, bytes]], progress: bool) -> None:
    await ensure_topics(s.kafka.bootstrap, [collection_spec(s.kafka, "default", COLLECTION)],
                        s.kafka.replication_factor, client_kwargs(s))
    started = time.monotonic()
    async with client_of(s) as client:
        for i in range(0, len(docs), 200):
            await asyncio.gather(*(client.put_image(COLLECTION, d, data, caption=f"a variant of {name}",
                                                    meta={"photo": name}) for d, name, data in docs[i:i + 200]))
        while True:
            ev = await (await client.retrieve(COLLECTION, _probe(docs[0][2]), k=1, deadline_ms=30_000)).result(60)
            held = ((ev.payload or {}).get("index") or {}).get("documents", 0)
            if held >= len(docs):
                break
            if progress:
                print(f"\rindexed {held}/{len(docs)} images ({time.monotonic() - started:.0f} s)", end="",
                      file=sys.stderr)
            await asyncio.sleep(2.0)
    if progress:
        print(f"\rindexed {len(docs)} images in {time.monotonic() - started:.1f} s", file=sys.stderr)


async def _run(s: Settings, cfg: BenchConfig, rate: float, progress: bool) -> dict[str, Any]:
    rng = random.Random(f"{cfg.seed}:{rate}:retrieve-images")
    offsets = arrival_offsets(rate, cfg.duration_s, rng)
    asked = await asyncio.to_thread(queries, len(offsets), cfg.seed + int(rate * 1000), cfg.repeat)
    requests = [Request(id=new_id(), parts=(_probe(data),), task=Task.RETRIEVE,
                        params=Params(collection=COLLECTION, k=K), lane=Lane(cfg.lane)) for _, data in asked]
    run, results = await search_run(s, cfg, rate, offsets, requests, "retrieve-images", progress)
    answers = [(name, p) for (name, _), p in zip(asked, results) if p is not None]

    def top1(rows: list[tuple[str, dict[str, Any]]]) -> float | None:
        hits = [(name, (p.get("hits") or [{}])[0].get("meta", {}).get("photo")) for name, p in rows]
        return round(sum(a == b for a, b in hits) / len(hits), 4) if hits else None

    reused = [a for a in answers if (a[1].get("index") or {}).get("reused")]
    searched = [a for a in answers if not (a[1].get("index") or {}).get("reused")]
    run["retrieval"].update(top1_same_photo={"all": top1(answers), "reused": top1(reused), "searched": top1(searched)},
                            space=next(((p.get("index") or {}).get("model") for _, p in answers), None))
    run["_asked"] = [(data, [str(h.get("id")) for h in p.get("hits") or ()], bool((p.get("index") or {}).get("reused")))
                     for (_, data), p in zip(asked, results) if p is not None]
    return run


def _recall(s: Settings, docs: list[tuple[str, str, bytes]], runs: list[dict[str, Any]]) -> None:
    """``recall_at_k`` of each run (see the module doc); the runs' ``_asked`` are consumed."""
    from schemas.documents import Document
    from streams.observe.metrics import Metrics
    from streams.stages.runner import embedder

    e = embedder(s, Metrics(), "bench", "image")

    def vectors(images: list[bytes]) -> np.ndarray:
        out = []
        for i in range(0, len(images), 32):
            got = e.embed([Document("", image=b, mime="image/jpeg") for b in images[i:i + 32]], "bench-recall")
            out += [v if not isinstance(v, Exception) else np.zeros_like(out[0]) for v in got]
        return np.vstack(out)

    ids = [d for d, _, _ in docs]
    matrix = vectors([b for _, _, b in docs])
    for run in runs:
        asked = run.pop("_asked")
        if not asked:
            continue
        exact = np.argsort(-(vectors([a[0] for a in asked]) @ matrix.T), axis=1)[:, :K]
        per = [(len({ids[j] for j in row} & set(got)) / K, reused) for row, (_, got, reused) in zip(exact, asked)]

        def mean(xs: list[float]) -> float | None:
            return round(float(np.mean(xs)), 4) if xs else None

        run["retrieval"]["recall_at_k"] = {"all": mean([r for r, _ in per]), "reused": mean([r for r, u in per if u]),
                                           "searched": mean([r for r, u in per if not u])}
