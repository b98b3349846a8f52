"""The generation engine against llama.cpp itself, side by side in one run, on the same GGUF
and thread count: ``python -m mmstream.genbench [--threads 1,2] [--streams 1,8] [--out FILE]``.

What it measures, each as the median of several rounds, alternating ours and the peer's:

- **TPOT at one stream**: ms per token once the prompt is in. Ours: the generator's
  ``GenerationCore`` over ``LlamaEngine`` (scheduler, sampling, stop detection included), as
  the stage runs it. Peer: llama-cpp-python's ``Llama`` streaming a completion, the way its
  users run it (``create_completion(stream=True)``).
- **tokens/s with N streams**: N different prompts decoded together. Ours: the core with N
  sequences. Peer: llama.cpp's batched decode as its ``examples/batched`` does it, written
  here on the same low-level API: one ``llama_batch`` of N tokens (one seq id each) per
  ``llama_decode``, greedy.
- **prefix-cached TTFT**: ms to the first token of a prompt seen just before. Ours: the
  same request again (the prefix cache links all its cells but the last token's). Peer:
  ``Llama`` given the same prompt again (it keeps its context and the stored logits answer:
  no evaluation at all). And another question after the same system prompt: ours links the
  shared head and computes the rest; ``Llama`` keeps the common prefix of its context and
  evaluates the rest.

Nothing here is asserted: the numbers go to stdout and ``--out`` (docs/generation.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from schemas.settings import Settings
from streams.cores.generation import GenerationCore, GenerationRequest
from streams.policies.scheduler import ContinuousBatchScheduler, SchedulerLimits
from workers.engines.lm import StopChecker
from workers.engines.lm_types import SamplingParams
from workers.engines.llama import LlamaEngine
from workers.models.smollm import GGUF_PRECISION, gguf_path
from workers.prompt import render_chatml
from workers.repository import ModelRepository

SYSTEM = "You are a helpful assistant. Answer briefly, in plain words, and keep to the question asked."
QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 plus 30?", "Explain what a Kafka topic is.", "Translate 'good morning' into French.",
             "Why is the sky blue?", "List four animals that live in the sea.", "What is a prime number?",
             "Give one tip for writing clear code.", "What does a compiler do?", "Name a planet with rings.",
             "What is the boiling point of water?", "Who wrote Hamlet?", "What is photosynthesis?",
             "Describe a cat in one sentence.")
DECODE_TOKENS = 48


def chat(question: str) -> str:
    return render_chatml([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


class Ours:
    """The generator's core over the llama.cpp engine, as the stage builds it."""

    def __init__(self, settings: Settings, threads: int, streams: int) -> None:
        import tokenizers

        config = ModelRepository(settings.models.repository).resolve(settings.models.lm_model)
        self.tokenizer = tokenizers.Tokenizer.from_file(str(config.tokenizer_path))
        self.engine = LlamaEngine.from_config(config, GGUF_PRECISION, threads=threads, max_sequences=max(streams, 2))
        limits = SchedulerLimits(max_running=max(streams, 2), max_kv_tokens=8192)
        scheduler = ContinuousBatchScheduler(limits, self.engine.eos_token_ids)
        self.core = GenerationCore(self.engine, scheduler, StopChecker(self.tokenizer, self.engine.eos_token_ids))
        self.n = 0

    def ids(self, question: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(chat(question), add_special_tokens=False).ids)

    def _submit(self, question: str, max_tokens: int) -> str:
        self.n += 1
        key = f"r{self.n}"
        # A new scope each time unless the caller wants reuse: no prefix hit across rounds.
        self.core.submit(GenerationRequest(key, self.ids(question), SamplingParams(max_tokens=max_tokens,
                         ignore_eos=True), "rt", time.monotonic(), cache_scope=key))
        return key

    def decode(self, streams: int) -> tuple[float, float]:
        """(median step ms once every stream decodes, tokens per second over those steps)."""
        keys = [self._submit(QUESTIONS[i % len(QUESTIONS)], DECODE_TOKENS + 200) for i in range(streams)]
        times: list[float] = []
        tokens = 0
        give_up = time.monotonic() + 120
        while len(times) < DECODE_TOKENS:
            if time.monotonic() > give_up:
                raise RuntimeError(f"no {DECODE_TOKENS} decode steps of {streams} streams in 120 s")
            started = time.perf_counter()
            updates = self.core.step()
            took = time.perf_counter() - started
            decoded = sum(u.new_tokens for u in updates)
            if self.core.last_step[2] == 0 and decoded == streams:  # a pure decode step of every stream
                times.append(took)
                tokens += decoded
        for key in keys:
            self.core.cancel(key)
        self.core.step()
        return statistics.median(times) * 1000, tokens / sum(times)

    def cached_ttft(self, warm: str, probe: str) -> float:
        """ms to the first token of ``probe`` submitted right after ``warm`` (one scope)."""
        self.n += 1
        scope = f"ttft{self.n}"
        self.core.submit(GenerationRequest("warm", self.ids(warm), SamplingParams(max_tokens=1), "rt",
                                           time.monotonic(), cache_scope=scope))
        while self.core.has_work:
            self.core.step()
        started = time.perf_counter()
        self.core.submit(GenerationRequest("probe", self.ids(probe), SamplingParams(max_tokens=2), "rt",
                                           time.monotonic(), cache_scope=scope))
        while True:
            if any(u.new_tokens for u in self.core.step()):
                took = (time.perf_counter() - started) * 1000
                break
        while self.core.has_work:
            self.core.step()
        return took


class Peer:
    """llama.cpp without us: llama-cpp-python's ``Llama`` and a batched-example loop."""

    def __init__(self, threads: int, streams: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(str(gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                                   n_batch=512, verbose=False)
        # The batched example's own context on the same weights: one cell range shared by all.
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
        params.n_seq_max, params.kv_unified = max(streams, 1), True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        self.streams = streams

    def tpot(self) -> float:
        stamps = []
        no_eos = {t: float("-inf") for t in (self.llm.token_eos(), *self.llm.tokenize(b"<|im_end|>", add_bos=False,
                                                                                         special=True))}
        for _ in self.llm.create_completion(chat(QUESTIONS[0]), max_tokens=DECODE_TOKENS, temperature=0.0,
                                            stream=True, stop=[], logit_bias=no_eos):
            stamps.append(time.perf_counter())
        gaps = np.diff(stamps[1:])
        return float(np.median(gaps)) * 1000

    def batched(self, streams: int) -> tuple[float, float]:
        lib, ctx = self.lib, self.ctx
        mem = lib.llama_get_memory(ctx)
        lib.llama_memory_clear(mem, True)
        vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.llm.model))
        prompts = [self.llm.tokenize(chat(QUESTIONS[i % len(QUESTIONS)]).encode(), add_bos=False, special=True)
                   for i in range(streams)]
        batch = lib.llama_batch_init(512, 0, streams)
        try:
            batch.n_tokens = 0
            for s, p in enumerate(prompts):  # every prompt in one batch, the last token of each with logits
                for pos, tok in enumerate(p):
                    i = batch.n_tokens
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = s, pos == len(p) - 1
                    batch.n_tokens += 1
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} on the prompts")
            index = [sum(len(p) for p in prompts[:s + 1]) - 1 for s in range(streams)]
            pos = [len(p) for p in prompts]
            times = []
            for _ in range(DECODE_TOKENS):
                started = time.perf_counter()  # a whole step, sampling included, as ours is timed
                nxt = [int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(vocab,))))
                       for i in index]
                batch.n_tokens = streams
                for s in range(streams):
                    batch.token[s], batch.pos[s], batch.n_seq_id[s] = nxt[s], pos[s], 1
                    batch.seq_id[s][0], batch.logits[s] = s, True
                    pos[s] += 1
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                times.append(time.perf_counter() - started)
                index = list(range(streams))
        finally:
            lib.llama_batch_free(batch)
            lib.llama_memory_clear(mem, True)
        return statistics.median(times) * 1000, streams * len(times) / sum(times)

    def cached_ttft(self, warm: str, probe: str) -> float:
        """ms to the first token of ``probe`` right after ``warm``: ``Llama`` keeps the longest
        common prefix of its context and evaluates the rest (the same prompt again: nothing,
        its stored logits answer)."""
        self.llm.create_completion(chat(warm), max_tokens=1, temperature=0.0)
        started = time.perf_counter()
        for _ in self.llm.create_completion(chat(probe), max_tokens=2, temperature=0.0, stream=True):
            return (time.perf_counter() - started) * 1000
        raise RuntimeError("no token")


def run(settings: Settings, threads: int, streams: int, rounds: int) -> dict[str, Any]:
    ours, peer = Ours(settings, threads, streams), Peer(threads, streams)
    rows: dict[str, list[float]] = {k: [] for k in ("ours_tpot_ms", "peer_tpot_ms", "ours_tok_s", "peer_tok_s",
                                                      "ours_cached_ttft_ms", "peer_cached_ttft_ms",
                                                      "ours_shared_system_ttft_ms", "peer_shared_system_ttft_ms")}
    for _ in range(rounds):
        rows["ours_tpot_ms"].append(ours.decode(1)[0])
        rows["peer_tpot_ms"].append(peer.tpot())
        if streams > 1:
            rows["ours_tok_s"].append(ours.decode(streams)[1])
            rows["peer_tok_s"].append(peer.batched(streams)[1])
        rows["ours_cached_ttft_ms"].append(ours.cached_ttft(QUESTIONS[1], QUESTIONS[1]))
        rows["ours_shared_system_ttft_ms"].append(ours.cached_ttft(QUESTIONS[0], QUESTIONS[1]))
        rows["peer_cached_ttft_ms"].append(peer.cached_ttft(QUESTIONS[1], QUESTIONS[1]))
        rows["peer_shared_system_ttft_ms"].append(peer.cached_ttft(QUESTIONS[0], QUESTIONS[1]))
    med = {k: round(statistics.median(v), 2) for k, v in rows.items() if v}
    ratios = {"tpot_ours_over_peer": round(med["ours_tpot_ms"] / med["peer_tpot_ms"], 3),
              "cached_ttft_ours_over_peer": round(med["ours_cached_ttft_ms"] / med["peer_cached_ttft_ms"], 3),
              "shared_system_ttft_ours_over_peer": round(med["ours_shared_system_ttft_ms"]
                                                         / med["peer_shared_system_ttft_ms"], 3)}
    if streams > 1:
        ratios["tok_s_ours_over_peer"] = round(med["ours_tok_s"] / med["peer_tok_s"], 3)
    return {"threads": threads, "streams": streams, "rounds": rounds, "median": med, "ratios": ratios,
            "samples": {k: [round(x, 2) for x in v] for k, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmstream.genbench", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2 (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=8, help="streams decoded together (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per setting (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    results = [run(settings, int(t), args.streams, args.rounds) for t in args.threads.split(",") if t.strip()]
    for r in results:
        print(json.dumps({k: r[k] for k in ("threads", "streams", "median", "ratios")}))
    if args.out:
        args.out.write_text(json.dumps({"generation_engine": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
