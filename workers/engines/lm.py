"""Text generation over the exported decoder graph (see ``workers.models.smollm``).

``LMEngine`` runs a BATCH of sequences of different lengths in one ONNX call: new tokens and
each sequence's KV history are left-padded to the longest in the batch, the attention mask
hides the padding, and position ids carry each token's true position, so a row computes what
it would compute alone (up to float summation order: fp32 greedy tokens are identical,
checked at build time and in tests). The dynamic int8 variant is not batch-invariant: its
activation scales are chosen per call over the whole batch, so a row's tokens can change
with its batch-mates (the build records ``batch_vs_alone_agreement``). Each ``LMSequence`` keeps its own KV
state between calls; a ``PrefixCache`` lets a new sequence start from the KV of a prompt
prefix seen before.

The generation core (``streams.cores.generation``) drives it: ``new_sequence`` when the
scheduler admits a request, ``forward`` once per step with every running sequence's chunk
(prompt chunks and decodes go in two calls), ``sample`` and ``append`` for each new token,
``release`` when a sequence ends.

Not thread-safe: one engine, one caller.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from workers.engines import EngineError, EngineInfo, EngineOptions, gpu
from workers.engines.lm_types import (LMError, LMSequence, PrefillChunk, SamplingParams, StepOutput, StepPlan, TokenEngine,
                                      sample_token)
from workers.prefix_cache import PrefixCache
from workers.repository import ModelConfig, VariantSpec

GENERATION_FILE = "generation.json"
__all__ = ["GENERATION_FILE", "LMEngine", "LMError", "LMSequence", "PrefillChunk", "SamplingParams", "StepOutput",
           "StepPlan", "StopChecker", "sample_token"]


class LMEngine(TokenEngine):
    """The decoder graph in one ONNX Runtime session, plus sampling and the prefix cache.

    The "lm-onnxruntime" backend of ``workers.engines``. ``config`` is the repository model
    (its version directory holds generation.json: layers, kv_heads, head_dim, eos ids,
    max_context; ``generation`` passes that content directly). ``prefix_cache`` None
    disables prefix reuse. ``run(chunks)`` is ``prefill``: one forward call over (sequence,
    new tokens) chunks, one logits row each.

    TensorRT is never asked for: every step has new KV shapes, and TensorRT would build an
    engine per shape. The KV cache lives in host memory (numpy), so on CUDA it crosses the
    bus each step: keeping it on the device (IO binding) is not done yet.
    """

    backend = "lm-onnxruntime"

    def __init__(
        self,
        config: ModelConfig,
        precision: str,
        intra_op_threads: int = 0,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        prefix_cache: PrefixCache | None = None,
        allow_spinning: bool = False,
        generation: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.precision = precision
        self.variant = config.variant(precision)  # fails early on an unbuilt precision
        if generation is None:
            generation = json.loads((config.directory / GENERATION_FILE).read_text(encoding="utf-8"))
        self.layers = int(generation["layers"])
        self.kv_heads = int(generation["kv_heads"])
        self.head_dim = int(generation["head_dim"])
        self.eos_token_ids = frozenset(int(t) for t in generation["eos_token_ids"])
        self.max_context = int(generation["max_context"])
        self.vocab_size = int(generation.get("vocab_size", 0))
        self.pad_token_id = min(self.eos_token_ids)  # any valid id: padded rows are masked
        self.prefix_cache = prefix_cache
        self.intra_op_threads = intra_op_threads
        self.allow_spinning = allow_spinning
        self.providers = tuple(p for p in providers if p != "TensorrtExecutionProvider")
        self.requested_provider = ""  # the first provider asked for that this build has (set by load)
        self._session: ort.InferenceSession | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, config: ModelConfig, precision: str, options: EngineOptions, **extra: Any) -> "LMEngine":
        """The registry's constructor (``workers.engines``); of ``extra`` it takes
        ``prefix_cache`` and ignores what other LM backends take (llama.cpp's slots)."""
        return cls(config, precision, options.intra_op_threads, options.providers,
                   allow_spinning=options.allow_spinning, prefix_cache=extra.get("prefix_cache"))

    @classmethod
    def from_config(cls, config: ModelConfig, precision: str, **kwargs: Any) -> "LMEngine":
        """The engine for ``precision`` of a built repository model, loaded."""
        engine = cls(config, precision, **kwargs)
        engine.load()
        return engine

    def load(self) -> EngineInfo:
        """Create the session; returns what runs. Raises ``EngineError`` when the graph is
        missing or no provider asked for is in this onnxruntime build."""
        path = self.config.model_path(self.precision)
        if not path.is_file():
            raise EngineError(f"{path} is missing: rebuild with `mmstream models build --force`")
        available = set(ort.get_available_providers())
        chosen = [p for p in self.providers if p in available]
        if not chosen:
            raise EngineError(f"none of the providers {list(self.providers)} is available "
                              f"(this onnxruntime has {sorted(available)})")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not self.allow_spinning:
            # Spinning threads steal cores from the broker and other stages on a shared box.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if chosen[0] != "CPUExecutionProvider":
            gpu.preload_for_onnxruntime()
        self.requested_provider = chosen[0]
        with self._lock:
            self._session = ort.InferenceSession(str(path), options, providers=chosen)
        return self.info

    @property
    def info(self) -> EngineInfo:
        """Raises ``EngineError`` before ``load``."""
        return EngineInfo(self.config.name, self.config.version, self.precision,
                          self._loaded().get_providers()[0], self.backend)

    @property
    def provider(self) -> str:
        """The execution provider that runs the graph, for metrics and the ready log."""
        return self.info.provider

    def run(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        """The engine contract's batch call: ``prefill``."""
        return self.prefill(chunks)

    def _loaded(self) -> ort.InferenceSession:
        if self._session is None:
            raise EngineError(f"{self.config.name} engine is not loaded: call load() first")
        return self._session

    # -- sequences ------------------------------------------------------------------------

    def new_sequence(self, seq_id: str, prompt: Sequence[int], params: SamplingParams,
                     cache_scope: str = "") -> LMSequence:
        """A sequence ready to prefill. With a prefix cache, the KV of the longest cached
        run of full prompt blocks is copied in (``num_cached`` says how many tokens; at
        least the last prompt token is always left to compute, for its logits); only blocks
        cached under the same ``cache_scope`` (a tenant) count. Raises ``LMError`` when
        prompt plus ``max_tokens`` exceed the context."""
        if not prompt:
            raise LMError("empty prompt")
        if len(prompt) + params.max_tokens > self.max_context:
            raise LMError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds "
                f"the context of {self.max_context}"
            )
        capacity = max(64, 1 << (len(prompt) + 16).bit_length())
        kv = np.zeros((self.layers, 2, self.kv_heads, capacity, self.head_dim), np.float32)
        seq = LMSequence(seq_id, list(prompt), len(prompt), params, kv,
                         rng=np.random.default_rng(params.seed))
        if self.prefix_cache is not None:
            seq.block_keys = self.prefix_cache.block_hashes(prompt, cache_scope)
            # Blocks ending at the last prompt token are not reused: it must be computed.
            usable = (len(prompt) - 1) // self.prefix_cache.block_tokens
            blocks = self.prefix_cache.lookup(seq.block_keys[:usable])
            size = self.prefix_cache.block_tokens
            for i, block in enumerate(blocks):
                kv[:, :, :, i * size:(i + 1) * size] = block
            seq.num_cached = len(blocks) * size
        return seq

    def release(self, seq: LMSequence) -> None:
        """Free the sequence's KV (the prefix cache keeps its own copies)."""
        seq.kv = np.zeros((0,), np.float32)

    # -- forward passes -------------------------------------------------------------------

    def prefill(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        """Compute the next ``n`` uncached prompt tokens of each (sequence, n) in one call;
        returns float32 [len(chunks), vocab]: the logits after each chunk's last token
        (meaningful as next-token logits when the chunk ends the prompt). A sequence whose
        prompt is now complete adds its full prompt blocks to the prefix cache."""
        logits = self._forward(chunks)
        if self.prefix_cache is not None:
            for seq, _ in chunks:
                if seq.num_cached >= seq.prompt_len:
                    self._cache_prompt(seq)
        return logits

    def forward(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        """One step's (sequence, n) chunks, one logits row each, in their order: the prompt
        chunks in one call and the decodes (one new token after a complete prompt) in
        another, since one padded call would pad every decode row to the longest chunk."""
        if not chunks:
            return np.zeros((0, self.vocab_size), np.float32)
        decodes = [i for i, (s, n) in enumerate(chunks) if n == 1 and s.num_cached >= s.prompt_len]
        prompts = [i for i in range(len(chunks)) if i not in set(decodes)]
        rows: dict[int, np.ndarray] = {}
        if prompts:
            rows.update(zip(prompts, self.prefill([chunks[i] for i in prompts])))
        if decodes:
            rows.update(zip(decodes, self.decode([chunks[i][0] for i in decodes])))
        return np.stack([rows[i] for i in range(len(chunks))])

    def decode(self, seqs: Sequence[LMSequence]) -> np.ndarray:
        """One token each: the last token (just appended) of every sequence; returns the
        next-token logits, float32 [len(seqs), vocab]."""
        for seq in seqs:
            if len(seq.tokens) - seq.num_cached != 1:
                raise LMError(f"{seq.seq_id}: decode needs exactly one new token, "
                              f"has {len(seq.tokens) - seq.num_cached}")
        return self._forward([(seq, 1) for seq in seqs])

    def _forward(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        if not chunks:
            return np.zeros((0, 0), np.float32)
        b = len(chunks)
        new = max(n for _, n in chunks)
        past = max(seq.num_cached for seq, _ in chunks)
        ids = np.full((b, new), self.pad_token_id, np.int64)
        pos = np.zeros((b, new), np.int64)
        mask = np.zeros((b, past + new), np.int64)
        past_kv = np.zeros((self.layers, 2, b, self.kv_heads, past, self.head_dim), np.float32)
        for row, (seq, n) in enumerate(chunks):
            start = seq.num_cached
            if n < 1 or start + n > len(seq.tokens):
                raise LMError(f"{seq.seq_id}: cannot compute {n} tokens from {start} of {len(seq.tokens)}")
            # Left padding: the last real token of every row sits in the last column.
            ids[row, new - n:] = seq.tokens[start:start + n]
            pos[row, new - n:] = np.arange(start, start + n)
            mask[row, past - start:past] = 1
            mask[row, past + new - n:] = 1
            past_kv[:, :, row, :, past - start:] = seq.kv[:, :, :, :start]
        session = self._loaded()
        with self._lock:
            logits, new_kv = session.run(
                ["logits", "new_kv"],
                {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "past_kv": past_kv},
            )
        for row, (seq, n) in enumerate(chunks):
            start = seq.num_cached
            self._reserve(seq, start + n)
            seq.kv[:, :, :, start:start + n] = new_kv[:, :, row, :, new - n:]
            seq.num_cached = start + n
        return logits

    def _reserve(self, seq: LMSequence, length: int) -> None:
        capacity = seq.kv.shape[3]
        if length <= capacity:
            return
        grown = np.zeros(seq.kv.shape[:3] + (max(length, 2 * capacity), self.head_dim), np.float32)
        grown[:, :, :, :seq.num_cached] = seq.kv[:, :, :, :seq.num_cached]
        seq.kv = grown

    def _cache_prompt(self, seq: LMSequence) -> None:
        assert self.prefix_cache is not None
        size = self.prefix_cache.block_tokens
        for i, key in enumerate(seq.block_keys):
            if key not in self.prefix_cache:
                self.prefix_cache.insert(key, seq.kv[:, :, :, i * size:(i + 1) * size].copy())



class StopChecker:
    """Incremental detokenization and stop-string detection for one tokenizer.

    ``check(seq)`` decodes the generated tokens into ``seq.text`` and says whether a stop
    string appeared (the text is then cut before it). End-of-turn tokens are not text.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, seq: LMSequence) -> bool:
        tokens = [t for t in seq.generated if t not in self.eos_token_ids]
        seq.text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for stop in seq.params.stop:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[:at]
                return True
        return False
