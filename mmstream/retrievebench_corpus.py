"""The retrieval bench's corpus, embedded once per machine: the passages of
``workers.retrieval.corpus`` in their fixed embedding order, and their vectors from the
pipeline's own text encoder run in-process, cached block by block under
``~/.cache/mmstream/retrieval/`` (an interrupted run resumes; a larger one embeds only what is new)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from schemas.settings import Settings
from workers import engines
from workers.encoders import batch_dependent
from workers.engines import EngineOptions
from workers.repository import ModelRepository
from workers.retrieval import corpus as C
from workers.text import PREPROCESSING_VERSION, TextEncoder, TextPreprocessor, normalize

CACHE_DIR = Path.home() / ".cache" / "mmstream" / "retrieval"
BLOCK = 4096
"""Passages embedded per cached block: an interrupted run resumes at its last block."""
EMBED_ORDER_SEED = "mmstream-retrieval-embed-order-v1"


class Embedder:
    """The pipeline's text encoder, in-process: what ``encode.text`` would answer."""

    def __init__(self, settings: Settings, threads: int) -> None:
        config = ModelRepository(settings.models.repository).resolve(settings.models.text_model)
        options = EngineOptions.from_settings(settings.encoder)
        options = EngineOptions(intra_op_threads=threads, allow_spinning=False, providers=options.providers)
        self.engine = engines.load_engine(config, settings.encoder.precision, options)
        self.pre = TextPreprocessor(config.tokenizer_path, config.max_length)
        self.encoder = TextEncoder(self.engine, self.pre, embedding_dim=config.embedding_dim)
        self.alone = batch_dependent(config, self.engine.precision)
        self.identity = f"{config.name}-{config.version}-{self.engine.precision}-{PREPROCESSING_VERSION}"
        self.dim = config.embedding_dim

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = [self.pre.ids(normalize(t)) for t in texts]
        if self.alone:  # as the stage runs this variant: each row alone
            out = [self.encoder.embed_ids([r])[0] for r in rows]
        else:
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths pad little
            out = [None] * len(rows)
            for s in range(0, len(order), 32):
                batch = order[s:s + 32]
                for i, v in zip(batch, self.encoder.embed_ids([rows[i] for i in batch])):
                    out[i] = v
        return np.stack(out).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)


def load_passages(cache_dir: Path) -> list[C.Passage]:
    """``corpus.load_corpus()``, cached under a digest of every source file's path, size and
    mtime (building it parses about 15k files: minutes on a small box)."""
    h = hashlib.sha256(C.CORPUS_VERSION.encode())
    for root in C.default_roots():
        for path in C.iter_files(root):
            st = path.stat()
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    cached = cache_dir / f"corpus-{h.hexdigest()[:16]}.json"
    if cached.exists():
        return [C.Passage(i, t, m) for i, t, m in json.loads(cached.read_text())]
    passages = C.load_corpus()
    cache_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(cached, json.dumps([[p.id, p.text, p.meta] for p in passages]).encode())
    return passages


def embed_order(passages: list[C.Passage]) -> list[C.Passage]:
    """``passages`` in the fixed pseudo-random order they are embedded in: a first ``--passages
    N`` is a sample of the whole corpus, and its blocks are the first ones of a full run (which
    resumes from them)."""
    order = list(range(len(passages)))
    random.Random(EMBED_ORDER_SEED).shuffle(order)
    return [passages[i] for i in order]


def embed_passages(embedder: Embedder, passages: list[C.Passage], cache_dir: Path,
                   from_end: bool = False, count: int | None = None) -> np.ndarray:
    """Unit vectors of the first ``count`` (default: all) of ``passages`` in order, from the
    cache or embedded (block by block, each block cached as it is done, so an interrupted run
    resumes and a larger ``count`` embeds only what is new). ``from_end``: the last block
    first (a second process beside a first one shares the work)."""
    count = len(passages) if count is None else min(count, len(passages))
    key = f"{C.fingerprint(passages)}-{embedder.identity}"
    final = cache_dir / f"emb-{key}.npy"
    if final.exists():
        return np.load(final, mmap_mode="r")[:count].copy()
    parts = cache_dir / f"emb-{key}.parts"
    parts.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    starts = list(range(0, count, BLOCK))
    for start in reversed(starts) if from_end else starts:
        path = parts / f"{start // BLOCK:05d}.npy"
        if not path.exists():
            block = embedder.embed([p.text for p in passages[start:start + BLOCK]])
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, block)
            os.replace(tmp, path)
            print(f"embedded passages {start}-{min(start + BLOCK, len(passages))} of {len(passages)} "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    if final.exists():  # the other process finished first
        return np.load(final, mmap_mode="r")[:count].copy()
    vectors = np.concatenate([np.load(parts / f"{start // BLOCK:05d}.npy") for start in starts])
    if count == len(passages):
        tmp = final.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, vectors)
        os.replace(tmp, final)
        shutil.rmtree(parts, ignore_errors=True)
    return vectors[:count]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
