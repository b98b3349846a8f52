"""Engines alone, per provider and precision: batch-1 floor, throughput, fidelity to fp32.

``python -m mmstream.enginebench --out FILE.json [--providers "cpu;cuda,cpu;tensorrt,cuda,cpu"]``
loads every ONNX embedding model of the repository through ``workers.engines.load_engine``
(the fidelity gate and its fallbacks included) once per provider list and precision, and
records for each: what actually served (precision, provider, fallbacks), the load time
(TensorRT builds its engines then), the median batch-1 time, items per second at
``--batch``, and the cosine of its first output to fp32's on the same provider list. The LM
is timed as greedy tokens per second. ``report(doc)`` turns the JSON into a Markdown table.
infra/gpu/check.sh runs it on a GPU machine; it runs anywhere (a CPU list gives the baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from schemas.settings import Settings
from workers.engines import EngineError, EngineOptions, load_engine, parse_providers
from workers.repository import ModelRepository

EMBEDDERS = ("text-embedding", "image-embedding")


class Fallbacks:
    """An ``Observer`` that keeps the fallbacks a load went through."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def engine_fallback(self, stage: str, from_: str, to: str, reason: str) -> None:
        self.seen.append({"from": from_, "to": to, "reason": reason})


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return round(statistics.median(times), 3)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    num = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return round(float(num.min()), 6)


def bench_embedder(config: Any, providers: tuple[str, ...], precisions: Sequence[str], batch: int,
                   repeats: int) -> list[dict[str, Any]]:
    rows, reference = [], None
    options = EngineOptions(providers=providers, max_batch=batch)
    for precision in ("fp32", *[p for p in precisions if p != "fp32"]):
        fallbacks = Fallbacks()
        row: dict[str, Any] = {"model": config.name, "providers": ",".join(providers), "requested": precision}
        start = time.perf_counter()
        try:
            engine = load_engine(config, precision, options, stage="bench", observer=fallbacks)
        except EngineError as exc:
            rows.append({**row, "error": str(exc), "fallbacks": fallbacks.seen})
            continue
        row.update(load_s=round(time.perf_counter() - start, 3), served=engine.precision,
                   provider=engine.info.provider, fallbacks=fallbacks.seen)
        one, many = engine.synthetic_feeds(batch=1), engine.synthetic_feeds(batch=batch)
        engine.warmup(3, one)
        engine.warmup(2, many)
        row["batch1_ms"] = median_ms(lambda: engine.run(one), repeats)
        row["batch"] = batch
        row["items_per_s"] = round(batch * 1000.0 / median_ms(lambda: engine.run(many), max(3, repeats // 4)), 1)
        probe = _probe(engine, batch)
        out = next(iter(engine.run(probe).values()))
        if precision == "fp32":
            reference = out
        row["min_cosine_to_fp32"] = cosine(out, reference) if reference is not None else None
        rows.append(row)
    return rows


def _probe(engine: Any, batch: int) -> dict[str, np.ndarray]:
    """Deterministic, non-constant inputs: token ids in the vocabulary's common range, pixels
    from a fixed-seed normal (what the model sees after normalization)."""
    rng = np.random.default_rng(0)
    feeds = engine.synthetic_feeds(batch=batch, length=24)
    for name, value in feeds.items():
        if np.issubdtype(value.dtype, np.integer) and name == "input_ids":
            feeds[name] = rng.integers(1000, 8000, value.shape).astype(value.dtype)
        elif np.issubdtype(value.dtype, np.floating):
            feeds[name] = rng.normal(0, 1, value.shape).astype(value.dtype)
    return feeds


def bench_lm(config: Any, providers: tuple[str, ...], precisions: Sequence[str], tokens: int = 32) -> list[dict[str, Any]]:
    rows = []
    for precision in ("fp32", *[p for p in precisions if p != "fp32"]):
        fallbacks = Fallbacks()
        row: dict[str, Any] = {"model": config.name, "providers": ",".join(providers), "requested": precision}
        try:
            engine = load_engine(config, precision, EngineOptions(providers=providers), stage="bench", observer=fallbacks)
        except EngineError as exc:
            rows.append({**row, "error": str(exc), "fallbacks": fallbacks.seen})
            continue
        engine.warmup(1)
        start = time.perf_counter()
        generated = engine.generate_greedy([engine.pad_token_id + 1] * 16, tokens)
        seconds = time.perf_counter() - start
        rows.append({**row, "served": engine.precision, "provider": engine.info.provider, "fallbacks": fallbacks.seen,
                     "tokens_per_s": round(len(generated) / seconds, 1)})
    return rows


def run(settings: Settings, provider_lists: Sequence[tuple[str, ...]], precisions: Sequence[str], batch: int,
        repeats: int, models: Sequence[str] | None = None) -> dict[str, Any]:
    repo = ModelRepository(settings.models.repository)
    names = list(models) if models else [settings.models.text_model, settings.models.image_model, settings.models.lm_model]
    rows: list[dict[str, Any]] = []
    for name in names:
        config = repo.resolve(name)
        for providers in provider_lists:
            if config.task in EMBEDDERS:
                rows += bench_embedder(config, providers, precisions, batch, repeats)
            elif config.backend == "lm-onnxruntime":
                rows += bench_lm(config, providers, precisions)
    return {"kind": "enginebench", "v": 1, "rows": rows}


def report(doc: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s rows, one line per (model, providers, requested precision)."""
    head = "| model | providers | requested | served | provider | load s | batch-1 ms | items/s | tokens/s | min cos to fp32 | fallbacks |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["rows"]:
        falls = ", ".join(f"{f['from']}->{f['to']} ({f['reason']})" for f in r.get("fallbacks", [])) or "-"
        cells = [r["model"], r["providers"], r["requested"], r.get("served", "ERROR"), r.get("provider", r.get("error", "")),
                 r.get("load_s", ""), r.get("batch1_ms", ""), r.get("items_per_s", ""), r.get("tokens_per_s", ""),
                 r.get("min_cosine_to_fp32", ""), falls]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmstream.enginebench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write (a .md report is written beside it)")
    parser.add_argument("--providers", default="cpu", help='provider lists separated by ";", e.g. "cpu;cuda,cpu"')
    parser.add_argument("--precisions", default="fp32,fp16,int8")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", action="append", help="model name (repeatable; default: text, image, LM)")
    args = parser.parse_args(argv)
    lists = [parse_providers(p) for p in args.providers.split(";") if p.strip()]
    doc = run(Settings.from_env(), lists, args.precisions.split(","), args.batch, args.repeats, args.model)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(doc))
    print(report(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
