"""Text generation on llama.cpp (llama-cpp-python's low-level API) over the packaged GGUF.

The "llama-cpp" backend of ``workers.engines``. It serves the GGUF as the package ships it
(4-bit weights, no dequantized export), and runs each scheduler step as ONE ``llama_decode``
over one batch that holds every sequence's tokens of that step, each token tagged with its
sequence's seq id: decodes (one token each) and prefill chunks side by side, so a long prompt
is chunked into decode steps instead of stalling them.

KV cache: one unified cache of ``kv_tokens + prefix_tokens`` cells shared by all sequences.
Live sequences use seq ids ``0 .. max_sequences-1`` (one slot each, freed as they finish);
the prefix cache uses the ids above them. A prompt whose leading tokens match a cached
prompt (same tenant scope) gets those cells by ``llama_memory_seq_cp``: shared, not copied,
not decoded again, to the token (positions need not be block-aligned here, as the ONNX
engine's hashed blocks must be); its last token is computed for its logits, unless the
whole prompt was cached with them (below). When
a prompt is complete it becomes a cached prompt the same way, with the logits after it
(replacing one it extends; the least recently used one evicted past ``prefix_slots`` or
``prefix_tokens``). So a system prompt that many requests share is decoded once, and a
repeated prompt decodes nothing: its last cell is linked too and its stored logits give the
first token (as llama.cpp's own server and llama-cpp-python do).

Same contract as ``workers.engines.lm.LMEngine`` where the generation core uses one:
``new_sequence``, ``forward`` (one step's (sequence, n) chunks, one logits row each),
``sample``, ``append``, ``release``, ``eos_token_ids``, ``max_context``. Not thread-safe:
one engine, one caller thread (the generation core's).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from workers.engines import EngineError, EngineInfo, EngineOptions
from workers.engines.lm_types import LMError, LMSequence, SamplingParams, TokenEngine
from workers.repository import ModelConfig, VariantSpec

GENERATION_FILE = "generation.json"
_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False


def _llama() -> Any:
    """The llama_cpp module, its backend initialized once per process and its log quiet."""
    global _BACKEND_READY
    try:
        import llama_cpp
    except ImportError as exc:  # the build is part of `make setup` (infra/llama-cpp.sh)
        raise EngineError(f"llama-cpp-python is not installed ({exc}): run `make setup`") from None
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
            llama_cpp.llama_backend_init()
            _BACKEND_READY = True
    return llama_cpp


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log goes nowhere: it prints every tensor while loading."""


class _Batch:
    """A ``llama_batch`` over numpy buffers (one seq id per token), filled without a Python
    loop per token. The buffers live as long as this object."""

    def __init__(self, llama_cpp: Any, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        base = self.seq.ctypes.data
        self.seq_ptrs = (ctypes.c_void_p * capacity)(*[base + 4 * i for i in range(capacity)])
        b = llama_cpp.llama_batch()
        b.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct = b


@dataclass(eq=False)
class _Prefix:
    """A cached prompt head held by its own seq id."""

    seq_id: int
    scope: str
    tokens: np.ndarray  # int32: a whole prompt, its cells held by ``seq_id``
    used_at: float
    logits: np.ndarray | None = None  # after the prompt's last token: a repeat of it needs no decode


class LlamaEngine(TokenEngine):
    """One GGUF in one llama.cpp context, decoding many sequences per step.

    ``max_sequences`` live sequences at once (the scheduler's ``max_running``), ``kv_tokens``
    KV cells for them (the scheduler reserves a sequence's prompt + max_tokens out of it),
    ``prefix_tokens`` more for cached prompt heads (0: no prefix reuse), ``threads`` for
    llama.cpp (0: one per core).
    """

    backend = "llama-cpp"

    def __init__(self, config: ModelConfig, precision: str, threads: int = 0, max_sequences: int = 8,
                 kv_tokens: int = 8192, prefix_tokens: int = 2048, prefix_slots: int = 8,
                 generation: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.precision = precision
        self.variant = config.variant(precision)  # fails early on an unbuilt variant
        if generation is None:
            generation = json.loads((config.directory / GENERATION_FILE).read_text(encoding="utf-8"))
        self.eos_token_ids = frozenset(int(t) for t in generation["eos_token_ids"])
        self.max_context = int(generation["max_context"])
        self.pad_token_id = min(self.eos_token_ids)
        self.threads = threads or (os.cpu_count() or 1)
        self.max_sequences = max(1, max_sequences)
        self.kv_tokens = max(self.max_context, kv_tokens)
        self.prefix_slots = prefix_slots if prefix_tokens > 0 else 0
        self.prefix_tokens = prefix_tokens if self.prefix_slots else 0
        self.batch_tokens = 512
        self.prefix_hits = 0  # prompt tokens served from cached prefixes, since load
        self._lib: Any = None
        self._model: Any = None
        self._ctx: Any = None
        self._mem: Any = None
        self._batch: _Batch | None = None
        self._n_vocab = 0
        self._free_slots: list[int] = []
        self._prefixes: list[_Prefix] = []

    @classmethod
    def from_options(cls, config: ModelConfig, precision: str, options: EngineOptions, **extra: Any) -> "LlamaEngine":
        """The registry's constructor; ``extra`` may set ``threads``, ``max_sequences``,
        ``kv_tokens``, ``prefix_tokens``, ``prefix_slots`` (the ONNX LM's ``prefix_cache``
        is not ours and is ignored)."""
        keys = ("threads", "max_sequences", "kv_tokens", "prefix_tokens", "prefix_slots")
        kwargs = {k: extra[k] for k in keys if k in extra}
        kwargs.setdefault("threads", options.intra_op_threads)
        return cls(config, precision, **kwargs)

    @classmethod
    def from_config(cls, config: ModelConfig, precision: str, **kwargs: Any) -> "LlamaEngine":
        engine = cls(config, precision, **kwargs)
        engine.load()
        return engine

    # -- life -----------------------------------------------------------------------------

    def load(self) -> EngineInfo:
        """Map the GGUF and make the context. Raises ``EngineError`` when the file is
        missing, llama.cpp is not installed, or llama.cpp refuses the model or context."""
        path = self.config.model_path(self.precision)
        if not path.is_file():
            raise EngineError(f"{path} is missing: rebuild with `mmstream models build --force`")
        lib = _llama()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise EngineError(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.kv_tokens + self.prefix_tokens
        cparams.n_batch = cparams.n_ubatch = self.batch_tokens
        cparams.n_seq_max = self.max_sequences + self.prefix_slots
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.kv_unified = True
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise EngineError(f"llama.cpp could not make a context of {cparams.n_ctx} tokens for {path}")
        self._lib, self._model, self._ctx = lib, model, ctx
        self._mem = lib.llama_get_memory(ctx)
        self._n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self._batch = _Batch(lib, self.batch_tokens)
        self._free_slots = list(range(self.max_sequences - 1, -1, -1))
        self._prefixes = []
        return self.info

    def close(self) -> None:
        """Free the context and the model (the engine is unusable after)."""
        if self._ctx is not None:
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = self._model = None

    @property
    def info(self) -> EngineInfo:
        if self._ctx is None:
            raise EngineError(f"{self.config.name} engine is not loaded: call load() first")
        return EngineInfo(self.config.name, self.config.version, self.precision,
                          f"cpu/llama.cpp/{self.threads}t", self.backend)

    @property
    def provider(self) -> str:
        return self.info.provider

    def run(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        """The engine contract's batch call: ``forward``."""
        return self.forward(chunks)

    # -- sequences ------------------------------------------------------------------------

    def new_sequence(self, seq_id: str, prompt: Sequence[int], params: SamplingParams,
                     cache_scope: str = "") -> LMSequence:
        """A sequence in a free slot, its longest cached prompt head (same scope; the last
        prompt token too, with its logits, when the whole prompt is cached) linked in. Raises ``LMError`` when the
        prompt is empty or prompt + ``max_tokens`` exceed the context, ``EngineError`` when
        no slot is free (the scheduler's ``max_running`` must not exceed ``max_sequences``)."""
        if not prompt:
            raise LMError("empty prompt")
        if len(prompt) + params.max_tokens > self.max_context:
            raise LMError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds "
                          f"the context of {self.max_context}")
        if not self._free_slots:
            raise EngineError(f"all {self.max_sequences} sequence slots are in use")
        slot = self._free_slots.pop()
        seq = LMSequence(seq_id, list(prompt), len(prompt), params, np.zeros(0, np.float32),
                         rng=np.random.default_rng(params.seed))
        seq.state = slot
        seq.scope = cache_scope
        hit = self._longest_prefix(np.asarray(prompt, np.int32), cache_scope)
        if hit is not None:
            prefix, n = hit
            self._lib.llama_memory_seq_cp(self._mem, prefix.seq_id, slot, 0, n)
            prefix.used_at = time.monotonic()
            seq.num_cached = n
            self.prefix_hits += n
            if (n == len(prompt) - 1 and len(prefix.tokens) == len(prompt) and prefix.logits is not None
                    and prefix.tokens[-1] == prompt[-1]):
                seq.reuse = prefix  # the same prompt: its last cell and logits are held too
        return seq

    def release(self, seq: LMSequence) -> None:
        """Free the sequence's slot and its KV cells (cells a cached prefix shares stay)."""
        slot = getattr(seq, "state", None)
        if slot is None or self._ctx is None:
            return
        self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)
        seq.state = None
        self._free_slots.append(slot)

    def _longest_prefix(self, prompt: np.ndarray, scope: str) -> tuple[_Prefix, int] | None:
        usable = len(prompt) - 1  # the last token is computed: its logits give the first output
        best: tuple[_Prefix, int] | None = None
        for prefix in self._prefixes:
            if prefix.scope != scope:
                continue
            n = _common_prefix(prefix.tokens, prompt, usable)
            if n and (best is None or n > best[1]):
                best = (prefix, n)
        return best

    def _remember_prompt(self, seq: LMSequence, logits: np.ndarray) -> None:
        """Keep the prompt (and the logits after it) as a cached prefix, unless a cached one
        already covers it; one it extends is replaced."""
        n = seq.prompt_len
        if not self.prefix_slots or n > self.prefix_tokens:
            return
        head = np.asarray(seq.tokens[:n], np.int32)
        for prefix in list(self._prefixes):
            if prefix.scope != seq.scope:
                continue
            common = _common_prefix(prefix.tokens, head, n)
            if common == n:  # already held
                prefix.used_at = time.monotonic()
                return
            if common == len(prefix.tokens):  # the new prompt extends it: keep the longer one
                self._drop_prefix(prefix)
        held = sum(len(p.tokens) for p in self._prefixes)
        while self._prefixes and (len(self._prefixes) >= self.prefix_slots or held + n > self.prefix_tokens):
            oldest = min(self._prefixes, key=lambda p: p.used_at)
            self._drop_prefix(oldest)
            held -= len(oldest.tokens)
        ids = {p.seq_id for p in self._prefixes}
        holder = next(i for i in range(self.max_sequences, self.max_sequences + self.prefix_slots) if i not in ids)
        self._lib.llama_memory_seq_cp(self._mem, seq.state, holder, 0, n)
        self._prefixes.append(_Prefix(holder, seq.scope, head, time.monotonic(), logits.copy()))

    def _drop_prefix(self, prefix: _Prefix) -> None:
        self._prefixes.remove(prefix)
        self._lib.llama_memory_seq_rm(self._mem, prefix.seq_id, -1, -1)

    # -- one step -------------------------------------------------------------------------

    def forward(self, chunks: Sequence[tuple[LMSequence, int]]) -> np.ndarray:
        """Compute the next ``n`` uncomputed tokens of each (sequence, n) in ONE batch (split
        only past ``batch_tokens``); returns float32 [len(chunks), vocab]: the logits after
        each chunk's last token. A sequence whose prompt is now complete is remembered as a
        cached prefix. Raises ``LMError`` for a chunk past a sequence's tokens and
        ``EngineError`` when llama.cpp fails (no KV room)."""
        if not chunks:
            return np.zeros((0, self._n_vocab), np.float32)
        if len({id(seq) for seq, _ in chunks}) != len(chunks):  # one (seq, pos) cell each, or KV breaks
            raise LMError("a sequence appears twice in one step")
        out = np.empty((len(chunks), self._n_vocab), np.float32)
        pending: list[tuple[int, LMSequence, int, int]] = []  # (row, seq, start, n) of this batch
        used = 0
        for row, (seq, n) in enumerate(chunks):
            start = seq.num_cached
            if n < 1 or start + n > len(seq.tokens) or getattr(seq, "state", None) is None:
                raise LMError(f"{seq.seq_id}: cannot compute {n} tokens from {start} of {len(seq.tokens)}")
            prefix, seq.reuse = seq.reuse, None
            if prefix is not None and prefix in self._prefixes and n == 1 and start == seq.prompt_len - 1:
                # A repeated prompt: its last cell is linked too, and its logits were stored.
                self._lib.llama_memory_seq_cp(self._mem, prefix.seq_id, seq.state, start, start + 1)
                out[row] = prefix.logits
                seq.num_cached += 1
                self.prefix_hits += 1
                continue
            while n > 0:  # a chunk larger than the batch goes over several decode calls
                take = min(n, self.batch_tokens - used)
                pending.append((row, seq, start, take))
                used += take
                start += take
                n -= take
                if used == self.batch_tokens:
                    self._decode(pending, out)
                    pending, used = [], 0
        if pending:
            self._decode(pending, out)
        for row, (seq, _) in enumerate(chunks):
            if seq.num_cached == seq.prompt_len:
                self._remember_prompt(seq, out[row])
        return out

    def _decode(self, pieces: list[tuple[int, LMSequence, int, int]], out: np.ndarray) -> None:
        b = self._batch
        assert b is not None
        i = 0
        last: list[tuple[int, int, LMSequence, int]] = []  # (batch index, row, seq, end)
        for row, seq, start, n in pieces:
            b.token[i:i + n] = seq.tokens[start:start + n]
            b.pos[i:i + n] = np.arange(start, start + n, dtype=np.int32)
            b.seq[i:i + n] = seq.state
            b.logits[i:i + n] = 0
            last.append((i + n - 1, row, seq, start + n))
            i += n
        for index, _, _, _ in last:
            b.logits[index] = 1
        b.struct.n_tokens = i
        rc = self._lib.llama_decode(self._ctx, b.struct)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc} for {i} tokens (KV cache full?)")
        for index, row, seq, end in last:
            ptr = self._lib.llama_get_logits_ith(self._ctx, index)
            out[row] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            seq.num_cached = end



def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    m = min(limit, len(a), len(b))
    if m <= 0:
        return 0
    same = a[:m] == b[:m]
    return m if same.all() else int(np.argmin(same))
