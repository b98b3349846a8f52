"""The text modality's compute, loaded only where an ``encode.text`` worker (or the generic
pool) starts: the tokenizer and the sentence-embedding engine (``workers/text.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import text
from workers.encoders import Runner, batch_dependent, load_engine, run_isolated, timed
from workers.modalities.text import SPEC
from workers.outputs import Observer, Prepared
from workers.text import TextEncoder, TextPreprocessor, normalize

# Lengths (tokens) and rows timed at start-up: enough shapes to separate the per-token and
# the attention (length squared) terms of the batch cost model.
CALIBRATION = ((1, 16), (8, 16), (16, 16), (1, 64), (4, 64), (1, 128), (2, 128), (1, 256))
CALIBRATION_REPEATS = 5
"""Best of five: calibration runs while the other stages start on the same cores."""


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage)
    pre = TextPreprocessor(config.tokenizer_path, config.max_length)
    encoder = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
    encoder.warmup()

    def prepare(job: EncodeJob) -> Prepared:
        if not isinstance(job.text, str):
            raise TypeError(f"text must be str, got {type(job.text).__name__}")
        normalized = normalize(job.text)
        ids = pre.ids(normalized)
        return Prepared(job, float(len(ids)), ids, content=normalized.encode())

    # A variant whose rows change with their batch-mates (dynamic int8 picks its activation
    # scales per call) runs each text alone: the same text then always gets the same answer
    # (and one closer to fp32: 0.993 vs 0.991 mean cosine on real sentences). On a CPU that
    # costs nothing measurable: this model's batches save no time per token there.
    alone = batch_dependent(config, engine.precision)

    def embed(ids: list[list[int]]) -> Any:
        return np.concatenate([encoder.embed_ids([row]) for row in ids]) if alone else encoder.embed_ids(ids)

    def run(items: list[Prepared]) -> list[Any]:
        if alone:
            return [run_isolated([item.data], encoder.embed_ids)[0] for item in items]
        return run_isolated([item.data for item in items], encoder.embed_ids)

    def calibrate() -> list[tuple[int, float, float]]:
        # Timed the way ``run`` executes a batch (rows alone: n times one row's cost).
        rows = []
        for n, length in CALIBRATION:
            ids = [[pre.ids("a")[0]] + [1000] * (length - 2) + [pre.ids("a")[-1]]] * n
            embed(ids)  # the first run of a shape sizes buffers: not timed
            rows.append((n, float(length), min(timed(lambda: embed(ids)) for _ in range(CALIBRATION_REPEATS))))
        return rows

    identity = f"{config.name}/{config.version}/{engine.precision}/{text.PREPROCESSING_VERSION}"
    return Runner(prepare, run, calibrate, identity, variable_length=True, cost_prior=(1.0, 0.1, 0.0002),
                  rows_alone=alone, config=config, precision=engine.precision, cache_content=cache_content,
                  preprocessing=text.PREPROCESSING_VERSION)


def cache_content(job: EncodeJob, settings: Settings) -> bytes | None:
    """The reuse cache keys a text on its normalized form."""
    return normalize(job.text or "").encode()
