"""The LM engine's plain data: the step plan a scheduler fills in and the engine executes
(``PrefillChunk``, ``StepPlan``, ``StepOutput``), sampling parameters and one sequence's state.

Re-exported by ``workers.engines.lm``, where the engine that uses them is described.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from workers.repository import ModelConfig, VariantSpec

@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Compute prompt tokens [start, start + num_tokens) of ``seq_id`` this step."""

    seq_id: str
    start: int
    num_tokens: int
    is_last: bool  # the chunk ends the prompt: its logits give the first output token


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One model step: a scheduler fills it in, the generation core has the engine run it."""

    decode: tuple[str, ...]  # sequences that generate one token each
    prefill: tuple[PrefillChunk, ...]  # prompt chunks to compute


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step produced: a token for every decoded sequence and every prefill chunk
    with ``is_last``; ``stopped`` names sequences whose text hit a stop string."""

    tokens: Mapping[str, int]
    stopped: frozenset[str] = frozenset()


class LMError(RuntimeError):
    """A generation request cannot run: prompt too long, bad sampling parameters."""

    code = "invalid_request"
    retriable = False


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature`` 0 is greedy (argmax, deterministic); otherwise
    logits / temperature, restricted to the smallest set with probability >= ``top_p``,
    sampled from a generator seeded with ``seed`` (same seed, same prompt, same tokens)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # generation ends when the text contains one; it is cut off
    ignore_eos: bool = False  # run to max_tokens past end-of-turn tokens (benchmarks, as vLLM's)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise LMError(f"invalid sampling parameters {self}")


@dataclass(eq=False)
class LMSequence:
    """One sequence's state: its tokens, how many of them have KV, and that KV.

    ``kv`` is [layers, 2, kv_heads, capacity, head_dim]; positions ``< num_cached`` are valid.
    """

    seq_id: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    params: SamplingParams
    kv: np.ndarray  # the ONNX engine's KV; empty for engines that keep KV themselves
    num_cached: int = 0
    text: str = ""  # generated text so far (stop strings cut off)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the prompt
    state: Any = None  # an engine's own handle (llama.cpp: the slot's seq id); None once released
    scope: str = ""  # whose cached prefixes it may reuse (a tenant; "" = shared)
    reuse: Any = None  # an engine's note that its next step is served from a cache (llama.cpp)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy when ``params.temperature`` is 0, else nucleus sampling with ``rng``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[order]) - probs[order] < params.top_p  # always keeps the top one
        trimmed = np.zeros_like(probs)
        trimmed[order[keep]] = probs[order[keep]]
        probs = trimmed / trimmed.sum()
    return int(rng.choice(len(probs), p=probs))


class TokenEngine:
    """What every LM engine does the same way over its own ``new_sequence`` / ``forward`` /
    ``release``: sampling, appending a token, greedy generation of one prompt alone (builds
    and tests; serving goes through the generation core) and the warm-up. A subclass sets
    ``eos_token_ids`` and ``pad_token_id``."""

    backend: str
    eos_token_ids: frozenset[int]
    pad_token_id: int

    @classmethod
    def from_config(cls, config: ModelConfig, precision: str, **kwargs: Any) -> Any:
        raise NotImplementedError

    def new_sequence(self, seq_id: str, prompt: Sequence[int], params: SamplingParams,
                     cache_scope: str = "") -> LMSequence:
        raise NotImplementedError

    def forward(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        raise NotImplementedError

    def release(self, seq: LMSequence) -> None:
        raise NotImplementedError

    @classmethod
    def from_file(cls, path: Path, generation: Mapping[str, Any], **kwargs: Any) -> Any:
        """An engine over a bare model file (an ONNX graph, a GGUF) and generation.json's
        content, loaded: for the model build, which measures a file before its config exists."""
        path = Path(path)
        config = ModelConfig(
            name=path.parent.name, version="0", task="text-generation", inputs=(), outputs=(),
            preprocessing_version="", embedding_dim=0, max_length=int(generation["max_context"]),
            tokenizer="", variants=MappingProxyType({"file": VariantSpec("file", path.name, 0, backend=cls.backend)}),
            build_key="", built_at="", directory=path.parent, backend=cls.backend,
        )
        return cls.from_config(config, "file", generation=generation, **kwargs)

    def sample(self, seq: LMSequence, logits: np.ndarray) -> int:
        """The next token of ``seq`` from its logits row, per its ``SamplingParams``."""
        return sample_token(logits, seq.params, seq.rng)

    def append(self, seq: LMSequence, token: int) -> None:
        seq.tokens.append(int(token))

    def generate_greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy tokens of one prompt, alone, stopping at an end-of-turn id (included) or
        ``max_tokens``; the sequence is released after."""
        seq = self.new_sequence("greedy", prompt, SamplingParams(max_tokens=max_tokens))
        try:
            logits = self.forward([(seq, seq.prompt_len - seq.num_cached)])[0]
            while True:
                token = int(np.argmax(logits))
                self.append(seq, token)
                if token in self.eos_token_ids or len(seq.generated) >= max_tokens:
                    return seq.generated
                logits = self.forward([(seq, 1)])[0]
        finally:
            self.release(seq)

    def teacher_forced(self, prompt: Sequence[int], reference: Sequence[int]) -> list[int]:
        """The greedy token this engine predicts at each step of ``reference`` given the
        reference before it (for the build's fidelity gate)."""
        tokens = list(prompt) + list(reference)
        seq = self.new_sequence(
            "teacher", tokens[:-1] or tokens, SamplingParams(max_tokens=1))
        try:
            predicted = []
            # Logits after prompt_len-1+j tokens predict reference[j]: one row per position.
            for j in range(len(reference)):
                end = len(prompt) + j
                logits = self.forward(
                    [(seq, end - seq.num_cached)])[0]
                predicted.append(int(np.argmax(logits)))
            return predicted
        finally:
            self.release(seq)

    def warmup(self, n: int = 1) -> list[float]:
        """Generate two tokens greedily after a four-token prompt, ``n`` times (prefill and
        decode both run); returns each round's seconds."""
        seconds = []
        for _ in range(n):
            start = time.perf_counter()
            self.generate_greedy([self.pad_token_id] * 4, 2)
            seconds.append(time.perf_counter() - start)
        return seconds
