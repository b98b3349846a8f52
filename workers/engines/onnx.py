"""The ONNX Runtime backend ("onnxruntime" in ``workers.engines.BACKENDS``): one batch of feeds at a time.

``OnnxEngine`` is the default backend. It tries execution providers in order (TensorRT,
CUDA, CPU by default), keeps those this onnxruntime build has, and reports the one that
ended up first in the session, so a worker's metrics say what actually runs.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort

from workers.engines import DEFAULT_PROVIDERS, EngineError, EngineInfo, EngineOptions, gpu
from workers.repository import ModelConfig

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PROVIDERS", "EngineError", "EngineInfo", "OnnxEngine"]


class OnnxEngine:
    """One precision variant of a repository model in an ONNX Runtime session.

    ``intra_op_threads`` 0 lets the runtime choose (one per core). ``trt_cache_dir`` is
    where TensorRT keeps the engines it builds (default: ``workers.engines.gpu.trt_cache_dir``,
    under the model's version directory); building one takes minutes, so it must survive
    restarts. ``max_batch`` bounds TensorRT's shape profile. TensorRT options per precision:
    ``workers.engines.gpu``.

    IO binding is not used: every encoder's next step (normalizing, top-5, the cache, the
    wire) needs its outputs in host memory, and its inputs come from host preprocessing, so
    binding would move the same bytes at the same moments.

    ``run`` is serialized by a lock: the worker calls it from one executor thread, and the
    lock keeps a stray second caller from interleaving with ``load``.
    """

    backend = "onnxruntime"

    def __init__(
        self,
        config: ModelConfig,
        precision: str,
        intra_op_threads: int = 0,
        providers: Sequence[str] = DEFAULT_PROVIDERS,
        trt_cache_dir: Path | None = None,
        allow_spinning: bool = False,
        max_batch: int = 16,
    ) -> None:
        if intra_op_threads < 0:
            raise ValueError(f"intra_op_threads must be >= 0, got {intra_op_threads}")
        self.config = config
        self.precision = precision
        self.variant = config.variant(precision)  # fails early on an unbuilt precision
        self.intra_op_threads = intra_op_threads
        self.allow_spinning = allow_spinning
        self.providers = tuple(providers)
        self.trt_cache_dir = trt_cache_dir
        self.max_batch = max_batch
        self.requested_provider = ""  # the first provider asked for that this build has (set by load)
        self._session: ort.InferenceSession | None = None
        self._output_names: list[str] = []
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, config: ModelConfig, precision: str, options: EngineOptions, **extra: Any) -> "OnnxEngine":
        """The registry's constructor (``workers.engines``); ``extra`` may set ``trt_cache_dir``."""
        return cls(config, precision, options.intra_op_threads, options.providers,
                   allow_spinning=options.allow_spinning, max_batch=options.max_batch, **extra)

    @property
    def input_names(self) -> tuple[str, ...]:
        """Graph inputs, as the model config declares them."""
        return tuple(t.name for t in self.config.inputs)

    @property
    def info(self) -> EngineInfo:
        """Raises ``EngineError`` before ``load``: the provider is only known after it."""
        session = self._loaded()
        return EngineInfo(
            model=self.config.name,
            version=self.config.version,
            precision=self.precision,
            provider=session.get_providers()[0],
            backend=self.backend,
        )

    def load(self) -> EngineInfo:
        """Create the session; returns what runs. Raises ``EngineError`` when no provider
        asked for is available in this onnxruntime build."""
        available = set(ort.get_available_providers())
        chosen = [p for p in self.providers if p in available]
        if not chosen:
            raise EngineError(
                f"none of the providers {list(self.providers)} is available "
                f"(this onnxruntime has {sorted(available)})"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        # One graph, run by one caller: parallelism between ops only adds thread churn.
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not self.allow_spinning:
            # Spinning worker threads shave microseconds off an idle box but steal whole
            # cores from the broker and the other stages on a shared one.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = self.config.model_path(self.precision)
        if not path.is_file():
            raise EngineError(f"{path} is missing: rebuild with `mmstream models build --force`")
        if chosen[0] != "CPUExecutionProvider":
            gpu.preload_for_onnxruntime()
        self.requested_provider = chosen[0]
        with self._lock:
            # onnxruntime drops a provider that fails to initialize (no GPU, missing CUDA
            # libraries) with a warning and goes on with the next; `info` reports the result.
            self._session = ort.InferenceSession(
                str(path), options, providers=[(p, self._provider_options(p)) for p in chosen]
            )
            self._output_names = [o.name for o in self._session.get_outputs()]
        info = self.info
        log.info("loaded %s/%s %s on %s", info.model, info.version, info.precision, info.provider)
        return info

    def _provider_options(self, provider: str) -> dict[str, Any]:
        if provider == "TensorrtExecutionProvider":
            cache = self.trt_cache_dir or gpu.trt_cache_dir(self.config, self.precision)
            try:
                cache.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a read-only repository: serve, but rebuild engines each start
                log.warning("no TensorRT engine cache at %s (%s): engines are rebuilt at every start", cache, exc)
                cache = None
            return gpu.trt_provider_options(self.config, self.precision, self.max_batch, cache)
        if provider == "CUDAExecutionProvider":
            return {"device_id": 0}
        return {}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. ``feeds`` maps every input name of the config to an array of its
        dtype; returns output name -> array, first axis the batch. Raises ``EngineError``
        when not loaded or an input is missing, and onnxruntime's errors as they are."""
        session = self._loaded()
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise EngineError(f"missing inputs {missing}; the model takes {list(self.input_names)}")
        with self._lock:
            values = session.run(self._output_names, feeds)
        return dict(zip(self._output_names, values))

    def warmup(self, n: int = 3, feeds: dict[str, np.ndarray] | None = None) -> list[float]:
        """Run ``n`` batches before the worker reports ready; returns each one's seconds.

        ``feeds`` defaults to a synthetic batch built from the config (batch 2, dynamic
        axes 16, integer inputs 1, float inputs 0). Callers that know the modality should
        pass real inputs (``TextEncoder.warmup`` does).
        """
        feeds = feeds if feeds is not None else self.synthetic_feeds()
        seconds = []
        for _ in range(n):
            start = time.perf_counter()
            self.run(feeds)
            seconds.append(time.perf_counter() - start)
        return seconds

    def synthetic_feeds(self, batch: int = 2, length: int = 16) -> dict[str, np.ndarray]:
        """A valid batch built from the input specs alone (for warm-up and smoke checks)."""
        feeds = {}
        for spec in self.config.inputs:
            shape = [
                (batch if i == 0 else length) if isinstance(d, str) else d
                for i, d in enumerate(spec.shape)
            ]
            dtype = np.dtype(spec.dtype)
            fill = 1 if np.issubdtype(dtype, np.integer) else 0
            feeds[spec.name] = np.full(shape, fill, dtype=dtype)
        return feeds

    def _loaded(self) -> ort.InferenceSession:
        if self._session is None:
            raise EngineError(f"{self.config.name} engine is not loaded: call load() first")
        return self._session
