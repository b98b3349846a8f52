"""The CTranslate2 backend ("ctranslate2" in ``workers.engines.BACKENDS``): Whisper's encoder and
decoder in one ``ctranslate2.models.Whisper``.

Why CTranslate2 and not ONNX Runtime for Whisper: see ``workers.audio``. ``ctranslate2`` and
faster-whisper's helpers are imported when the engine loads, so importing this module is
cheap on a worker that never serves audio.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from workers.audio import MEL_FRAMES, WINDOW_SAMPLES
from workers.engines import EngineError, EngineInfo, EngineOptions, gpu
from workers.repository import ModelConfig

log = logging.getLogger(__name__)

MAX_DECODE_TOKENS = 448  # Whisper's text context
# Whisper's own test for a window without speech (openai/whisper's transcribe defaults).
NO_SPEECH_PROB = 0.6
MIN_MEAN_LOGPROB = -1.0


class WhisperEngine:
    """One precision of the Whisper model in a CTranslate2 ``Whisper`` (encoder + decoder).

    ``precision`` "fp32" or "int8" (int8 weights; int8_float16 on a GPU).
    ``intra_op_threads`` 0 lets CTranslate2 choose. ``device`` "auto" takes the first CUDA
    device when CTranslate2 sees one, else the CPU. Calls are serialized by a lock.
    ``run(features)`` is ``encode``: a batch of log-mel windows in, one encoder output per
    window out (``transcribe`` decodes them).
    """

    backend = "ctranslate2"

    def __init__(
        self,
        config: ModelConfig,
        precision: str,
        intra_op_threads: int = 0,
        allow_spinning: bool = False,  # accepted for the runner; CTranslate2 threads do not spin
        device: str = "auto",
    ) -> None:
        if intra_op_threads < 0:
            raise ValueError(f"intra_op_threads must be >= 0, got {intra_op_threads}")
        self.config = config
        self.precision = precision
        self.variant = config.variant(precision)  # fails early on an unbuilt precision
        self.intra_op_threads = intra_op_threads
        self.device = device
        self._model: Any = None
        self._tokenizer: Any = None
        self._features: Any = None
        self._provider = ""
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, config: ModelConfig, precision: str, options: EngineOptions, **extra: Any) -> "WhisperEngine":
        """The registry's constructor (``workers.engines``). A provider list without CUDA keeps
        Whisper on the CPU; with it, the first CUDA device CTranslate2 sees is used.
        ``extra`` may set ``device`` outright."""
        extra.setdefault("device", "auto" if "CUDAExecutionProvider" in options.providers else "cpu")
        return cls(config, precision, options.intra_op_threads, **extra)

    @property
    def model_dir(self) -> Path:
        """The CTranslate2 model directory (model.bin, its config.json, tokenizer.json)."""
        return self.config.model_path(self.precision).parent

    @property
    def info(self) -> EngineInfo:
        """Raises ``EngineError`` before ``load``. ``provider`` is CTranslate2's device and
        compute type, e.g. "cpu/int8" or "cuda/int8_float16"."""
        self._loaded()
        return EngineInfo(self.config.name, self.config.version, self.precision, self._provider, self.backend)

    def load(self) -> EngineInfo:
        """Load the model; raises ``EngineError`` when its files are missing or unusable."""
        import ctranslate2
        import tokenizers
        from faster_whisper.feature_extractor import FeatureExtractor

        path = self.config.model_path(self.precision)
        if not path.is_file():
            raise EngineError(f"{path} is missing: rebuild with `mmstream models build --force`")
        device = self.device
        if device != "cpu":
            gpu.preload_for_ctranslate2()
        if device == "auto":
            device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        compute_type = {"fp32": "float32", "int8": "int8" if device == "cpu" else "int8_float16"}.get(self.precision)
        if compute_type is None:
            raise EngineError(f"precision {self.precision!r} is not served by {self.backend}; use fp32 or int8")
        try:
            model = ctranslate2.models.Whisper(
                str(self.model_dir), device=device, compute_type=compute_type, intra_threads=self.intra_op_threads
            )
            tokenizer = tokenizers.Tokenizer.from_file(str(self.config.tokenizer_path))
        except (RuntimeError, ValueError, OSError) as e:
            raise EngineError(f"cannot load {self.model_dir} on {device} as {compute_type}: {e}") from None
        with self._lock:
            self._model, self._tokenizer, self._provider = model, tokenizer, f"{device}/{compute_type}"
            self._features = FeatureExtractor(feature_size=model.n_mels)
        info = self.info
        log.info("loaded %s/%s %s on %s", info.model, info.version, info.precision, info.provider)
        return info

    def run(self, features: np.ndarray) -> Any:
        """The engine contract's batch call: ``encode``."""
        return self.encode(features)

    def warmup(self, n: int = 1) -> list[float]:
        """Encode ``n`` silent windows; returns each call's seconds. ``AudioEncoder.warmup``
        warms the whole path (VAD, features, decoding) and is what a worker calls."""
        silent = np.zeros((1, self._loaded().n_mels, MEL_FRAMES), np.float32)
        seconds = []
        for _ in range(n):
            start = time.perf_counter()
            self.encode(silent)
            seconds.append(time.perf_counter() - start)
        return seconds

    def features(self, window: np.ndarray) -> np.ndarray:
        """Log-mel features [n_mels, 3000] of up to 30 s of 16 kHz samples (zero-padded)."""
        self._loaded()
        padded = np.zeros(WINDOW_SAMPLES, dtype=np.float32)
        padded[: len(window)] = window[:WINDOW_SAMPLES]
        return self._features(padded)[:, :MEL_FRAMES]

    def encode(self, features: np.ndarray) -> Any:
        """Encoder output for features [batch, n_mels, 3000]: a CTranslate2 StorageView in host
        memory, [batch, 1500, d_model] (pass it to ``transcribe``; ``np.asarray`` reads it
        without a copy)."""
        import ctranslate2

        model = self._loaded()
        with self._lock:
            return model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(features, np.float32)), to_cpu=True)

    def transcribe(self, encoded: Any, languages: Sequence[str | None], beam_size: int = 1) -> list[tuple[str, str]]:
        """(text, language) per row of ``encoded``; a None language is detected from that row.

        A row Whisper itself judges silent (Whisper's rule: no-speech probability above 0.6
        and mean token log-probability below -1) gets "": the VAD lets through some music
        and noise, on which Whisper otherwise invents stock phrases ("Thank you.").
        """
        from faster_whisper.tokenizer import Tokenizer

        model = self._loaded()
        with self._lock:
            detected = model.detect_language(encoded) if any(lang is None for lang in languages) else None
            chosen = [
                lang if lang is not None else detected[i][0][0][2:-2]  # "<|en|>" -> "en"
                for i, lang in enumerate(languages)
            ]
            tokenizers = [Tokenizer(self._tokenizer, True, task="transcribe", language=lang) for lang in chosen]
            prompts = [[t.sot, t.language, t.transcribe, t.no_timestamps] for t in tokenizers]
            results = model.generate(
                encoded, prompts, beam_size=beam_size, max_length=MAX_DECODE_TOKENS,
                suppress_blank=True, suppress_tokens=[-1], return_scores=True, return_no_speech_prob=True,
            )  # fmt: skip
        out = []
        for tokenizer, result, lang in zip(tokenizers, results, chosen):
            # scores[0] is the sequence log-probability divided by its length (length_penalty 1).
            silent = result.no_speech_prob > NO_SPEECH_PROB and result.scores[0] < MIN_MEAN_LOGPROB
            out.append(("" if silent else tokenizer.decode(result.sequences_ids[0]).strip(), lang))
        return out

    def _loaded(self) -> Any:
        if self._model is None:
            raise EngineError(f"{self.config.name} engine is not loaded: call load() first")
        return self._model
