"""How far llama.cpp's logits move with where a prompt's prefill is cut: the measurement
behind "same answers" with the prefix cache on the q4_1 generator (docs/retrieval.md).

A RAG-shaped prompt (a system prompt, passages, a question) is prefilled without any prefix
cache, whole and cut into chunks of several sizes, and again cut where a cached head would
end; for each cut it reports the largest logit difference against the whole prefill and
whether 16 greedy tokens agree. In-process, one thread, real weights from the model
repository; no broker.

    python -m mmstream.bench.prefill_cuts [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from schemas.settings import Settings
from workers.engines import load_engine
from workers.engines.lm_types import SamplingParams
from workers.models.smollm import GGUF_PRECISION
from workers.prompt import render_chatml
from workers.repository import ModelRepository

QUESTIONS = ("When does the river fox drink?", "Where does the fox sleep?", "Who is lazy?")
GREEDY = 16


def prompts(tok: Any) -> list[list[int]]:
    passages = " ".join(f"[{i}] The quick brown fox number {i} jumps over the lazy dog and runs to the river "
                        "bank to drink." for i in range(12))
    return [tok.encode(render_chatml([{"role": "system", "content": "Answer from the passages. " + passages},
                                      {"role": "user", "content": q}]), add_special_tokens=False).ids
            for q in QUESTIONS]


def run(engine: Any, prompt: list[int], cuts: list[int]) -> tuple[np.ndarray, list[int], float]:
    """The logits after the prompt prefilled in chunks ending at ``cuts`` (then the rest),
    the greedy tokens after it, and the prefill's seconds."""
    seq = engine.new_sequence("p", prompt, SamplingParams(max_tokens=GREEDY))
    started = time.perf_counter()
    for end in [*cuts, len(prompt)]:
        if end > seq.num_cached:
            logits = engine.forward([(seq, end - seq.num_cached)])[0].copy()
    took = time.perf_counter() - started
    first, out = logits, []
    for _ in range(GREEDY):
        token = int(np.argmax(logits))
        out.append(token)
        engine.append(seq, token)
        logits = engine.forward([(seq, 1)])[0]
    engine.release(seq)
    return first, out, took


def measure(threads: int) -> dict[str, Any]:
    import tokenizers

    config = ModelRepository(Settings.from_env().models.repository).resolve("smollm2-135m")
    tok = tokenizers.Tokenizer.from_file(str(config.tokenizer_path))
    engine = load_engine(config, GGUF_PRECISION, threads=threads, prefix_tokens=0)
    ps = prompts(tok)
    head = len(os.path.commonprefix([ps[0], ps[1]]))  # where a cached head of the first would end
    rows = []
    whole = [run(engine, p, []) for p in ps]
    plans = {f"{head} + rest (a cached head's cut)": lambda n: [head],
             **{f"{c} at a time": (lambda c: lambda n: list(range(c, n, c)))(c) for c in (163, 64, 32, 16, 8)}}
    for name, plan in plans.items():
        got = [run(engine, p, plan(len(p))) for p in ps]
        rows.append({"cuts": name, "max_logit_diff": [round(float(np.abs(g[0] - w[0]).max()), 4)
                                                      for g, w in zip(got, whole)],
                     "same_greedy": [g[1] == w[1] for g, w in zip(got, whole)],
                     "prefill_s": [round(g[2], 3) for g in got]})
    return {"model": f"{config.name}/{config.version}/{GGUF_PRECISION}", "threads": threads,
            "prompt_tokens": [len(p) for p in ps], "whole_prefill_s": [round(w[2], 3) for w in whole], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    print(json.dumps(measure(ap.parse_args(argv).threads), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
