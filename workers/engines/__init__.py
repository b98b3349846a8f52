"""Engines: one loaded model variant behind one small protocol, chosen by name from a registry.

The contract every backend keeps (``Engine``):

- ``Cls.from_options(config, precision, options, **extra)`` builds an UNLOADED engine for one
  precision variant of a repository model (``workers.repository.ModelConfig``); it reads only
  the config and fails early (``ModelNotFoundError``) on a precision that was never built.
  ``options`` (``EngineOptions``) says how to run any backend; each backend takes the fields
  it understands and ignores the rest. ``extra`` is what only that backend knows
  (the LM's ``prefix_cache``, Whisper's ``device``).
- ``load()`` creates the runtime session and returns ``EngineInfo``; it raises
  ``EngineError`` when the variant cannot run here (missing file, no usable provider).
- ``info`` is what runs: model, version, precision, the provider (device) actually in use and
  the backend name. It raises ``EngineError`` before ``load``.
- ``warmup(n)`` runs ``n`` representative batches and returns each one's seconds; a worker
  calls it (or a modality-aware warm-up of its own) before it reports ready.
- ``run(batch)`` runs one batch and returns one output per input row; what a batch is
  belongs to the backend (ONNX feeds, Whisper features, LM chunks: see each ``run``).

``load_engine`` builds and loads through the registry and the fidelity gate
(``workers.engines.gate``): a refused variant falls back to the next, counted.

The registry maps a backend name, as the model's config.json names it
(``ModelConfig.backend``), to ``"module:Class"``. ``engine_class`` imports the module on first
use, so a worker imports only the runtime it serves. A native TensorRT backend is one new
module in this package (a class keeping the contract above) plus one line in ``BACKENDS``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from workers.engines.gate import Refusal, check_provider, check_variant, fallback_chain
from workers.repository import ModelConfig

log = logging.getLogger(__name__)

# Provider names of ONNX Runtime, in the order they are tried; short aliases for settings.
PROVIDER_ALIASES = {
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
DEFAULT_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")

BACKENDS: dict[str, str] = {
    "onnxruntime": "workers.engines.onnx:OnnxEngine",
    "ctranslate2": "workers.engines.ctranslate2:WhisperEngine",
    "lm-onnxruntime": "workers.engines.lm:LMEngine",
    "llama-cpp": "workers.engines.llama:LlamaEngine",
}


class EngineError(RuntimeError):
    """The engine cannot load or run: no usable provider, not loaded, bad feeds."""

    code = "internal"
    retriable = False


@dataclass(frozen=True)
class EngineInfo:
    """What a worker serves, for its ready log line and the engine-info metric."""

    model: str
    version: str
    precision: str  # variant served: "fp32", "int8", ...
    provider: str  # execution provider (or device) in use, e.g. "CPUExecutionProvider", "cuda/int8_float16"
    backend: str  # registry name: "onnxruntime", "ctranslate2", "lm-onnxruntime"


@dataclass(frozen=True)
class EngineOptions:
    """How to run an engine, whatever its backend (from ``EncoderSettings``: ``from_settings``)."""

    intra_op_threads: int = 0  # 0: the runtime chooses (one per core)
    allow_spinning: bool = False  # ONNX Runtime only: spinning threads steal cores on a shared box
    providers: tuple[str, ...] = DEFAULT_PROVIDERS  # tried in order; CTranslate2 uses CUDA when listed
    max_batch: int = 16  # TensorRT shape profiles are built up to this batch size

    @classmethod
    def from_settings(cls, encoder: Any) -> "EngineOptions":
        """From ``schemas.settings.EncoderSettings`` (its ``providers`` is a comma list)."""
        return cls(
            intra_op_threads=encoder.intra_op_threads,
            allow_spinning=encoder.allow_spinning,
            providers=parse_providers(encoder.providers),
            max_batch=encoder.max_batch_size,
        )


def parse_providers(text: str) -> tuple[str, ...]:
    """``"tensorrt,cuda,cpu"`` (aliases or full ONNX Runtime names) -> full names, in order.

    Raises ``ValueError`` on an empty list or an unknown short name (a full name, one ending
    in ``ExecutionProvider``, is passed through for onnxruntime to judge).
    """
    out = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name = PROVIDER_ALIASES.get(item.lower(), item)
        if not name.endswith("ExecutionProvider"):
            raise ValueError(f"unknown provider {item!r}; use {sorted(PROVIDER_ALIASES)} or a full ONNX Runtime name")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("the provider list is empty")
    return tuple(out)


B = TypeVar("B", contravariant=True)
R = TypeVar("R", covariant=True)


@runtime_checkable
class Engine(Protocol[B, R]):
    """One precision variant of one model, loaded into a runtime (see the module docstring).

    ``isinstance(engine, Engine)`` checks the members exist; on Python 3.11 it reads ``info``,
    so ask it of a loaded engine.
    """

    backend: ClassVar[str]
    precision: str

    @classmethod
    def from_options(cls, config: ModelConfig, precision: str, options: EngineOptions, **extra: Any) -> Any: ...

    @property
    def info(self) -> EngineInfo: ...

    def load(self) -> EngineInfo: ...

    def warmup(self, n: int = ...) -> list[float]: ...

    def run(self, batch: B) -> R: ...


def engine_class(backend: str) -> type:
    """The class serving ``backend``, its module imported now (not at import time: a worker
    that serves only text never imports CTranslate2). Raises ``EngineError`` naming the
    known backends for an unknown name."""
    try:
        target = BACKENDS[backend]
    except KeyError:
        raise EngineError(f"unknown engine backend {backend!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module, _, name = target.partition(":")
    # Lazy on purpose: each backend module imports its runtime (onnxruntime, ctranslate2).
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def load_engine(config: ModelConfig, precision: str, options: EngineOptions = EngineOptions(),
                backend: str | None = None, *, stage: str = "", observer: Any = None, **extra: Any) -> Any:
    """The loaded engine serving ``precision`` of ``config``, or the next variant of its
    fallback chain (``workers.engines.gate``) when the gate or the load refuses it.

    Each variant is served by its own backend (``ModelConfig.backend_of``: a GGUF variant by
    llama.cpp, the model's ONNX graphs by ONNX Runtime); ``backend`` overrides it for every
    variant. Each refusal is
    logged with its reason and reported to ``observer.engine_fallback(stage, from, to,
    reason)`` (a ``workers.outputs.Observer``; None reports nothing), and so is a provider
    the runtime skipped. ``engine.info`` says what runs. Raises ``EngineError`` for an
    unknown backend, and when no variant of the chain can be served (naming every reason).
    """
    chain = fallback_chain(precision)
    where = stage or f"{config.name}/{config.version}"
    refusals: list[Refusal] = []
    for i, candidate in enumerate(chain):
        refusal = check_variant(config, candidate)
        if refusal is None:
            cls = engine_class(backend or config.backend_of(candidate))
            engine = cls.from_options(config, candidate, options, **extra)
            try:
                info = engine.load()
            except Exception as exc:  # runtimes raise their own types (onnxruntime's Fail is no RuntimeError)
                refusal = Refusal(candidate, "load_failed", f"{config.name} {candidate} did not load: {exc}")
            else:
                refusal = check_provider(candidate, info.provider)
        if refusal is None:
            _report_skipped_provider(engine, where, stage, observer)
            return engine
        to = chain[i + 1] if i + 1 < len(chain) else "none"
        log.warning("%s: refusing %s (%s): %s; %s", where, candidate, refusal.reason, refusal.detail,
                    f"falling back to {to}" if to != "none" else "no variant left")
        if observer is not None:
            observer.engine_fallback(stage, candidate, to, refusal.reason)
        refusals.append(refusal)
    raise EngineError(f"no variant of {config.name}/{config.version} can be served: "
                      + "; ".join(r.detail for r in refusals))


def _report_skipped_provider(engine: Any, where: str, stage: str, observer: Any) -> None:
    """ONNX Runtime moves past a provider that fails to start (TensorRT without its
    libraries, CUDA without a device) on its own; say so where it happened."""
    asked, got = getattr(engine, "requested_provider", ""), engine.info.provider
    if asked and asked != got:
        log.warning("%s: asked for %s, runs on %s", where, asked, got)
        if observer is not None:
            observer.engine_fallback(stage, asked, got, "provider_failed")
