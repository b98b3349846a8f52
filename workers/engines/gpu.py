"""What the engines need on a GPU: TensorRT execution-provider options and the CUDA libraries.

TensorRT (through ONNX Runtime's TensorRT provider):

- precision: the fp16 variant gets ``trt_fp16_enable``; an int8 variant with Q/DQ nodes
  (static quantization, the image model's) gets ``trt_int8_enable`` and runs as explicit
  quantization, with no calibration table. Dynamic int8 (MatMulInteger, the text model's)
  has no TensorRT kernels: those nodes go to CUDA. fp32 stays fp32: TensorRT never lowers
  precision on its own, so what runs is what the fidelity gate measured.
- engine and timing caches: building an engine takes seconds to minutes, so it is kept on
  disk under the model's version directory, keyed like the model cache (model, version,
  precision: the directory and its name) plus what makes a TensorRT engine invalid (the
  onnxruntime and TensorRT versions and the GPU model): ``trt_cache_dir``. A rebuilt model
  replaces its version directory, and its caches with it.
- shape profiles: one profile from batch 1 to ``max_batch`` and from 1 to the model's
  ``max_length`` on its other dynamic axes, so a new batch size or text length never
  triggers an engine rebuild in the middle of serving.

CUDA libraries: onnxruntime-gpu and CTranslate2 find CUDA, cuDNN and TensorRT in the nvidia
pip wheels only once someone loads them (``preload_for_*``): onnxruntime-gpu's ``preload_dlls``
and the ``tensorrt_libs`` package; CTranslate2's cuBLAS 12 from the nvidia-cublas-cu12 wheel.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
import re
from pathlib import Path
from typing import Any, Sequence

from workers.repository import ModelConfig, TensorSpec

log = logging.getLogger(__name__)

TRT_DISTRIBUTIONS = ("tensorrt-cu13-libs", "tensorrt-cu12-libs", "tensorrt")
_preloaded = False


def shape_profiles(inputs: Sequence[TensorSpec], max_batch: int, max_length: int) -> tuple[str, str, str]:
    """TensorRT's (min, opt, max) shape strings for ``inputs``, e.g. ``"input_ids:1x1"``.

    Axis 0 (named) is the batch: 1, half of ``max_batch``, ``max_batch``. Other named axes
    range over 1, min(64, max_length), max_length. Fixed axes keep their size.
    """
    if max_batch < 1 or max_length < 1:
        raise ValueError(f"max_batch and max_length must be >= 1, got {max_batch}, {max_length}")
    out = []
    for pick in (0, 1, 2):
        shapes = []
        for spec in inputs:
            dims = []
            for axis, dim in enumerate(spec.shape):
                if isinstance(dim, int):
                    dims.append(dim)
                elif axis == 0:
                    dims.append((1, max(1, max_batch // 2), max_batch)[pick])
                else:
                    dims.append((1, min(64, max_length), max_length)[pick])
            shapes.append(f"{spec.name}:{'x'.join(str(d) for d in dims)}")
        out.append(",".join(shapes))
    return out[0], out[1], out[2]


def is_qdq(config: ModelConfig, precision: str) -> bool:
    """Whether the variant is statically quantized with Q/DQ nodes (the build says so)."""
    return "QDQ" in str(config.variant(precision).fidelity.get("quantization", ""))


def trt_cache_dir(config: ModelConfig, precision: str) -> Path:
    """``<version dir>/trt-cache/<precision>-ort<v>-trt<v>-<gpu>``: one directory per set of
    things that invalidate a TensorRT engine (model files are the version directory's)."""
    import onnxruntime as ort  # this module is imported by the ONNX engine, which has it loaded

    key = f"{precision}-ort{ort.__version__}-trt{tensorrt_version() or 'none'}-{_slug(gpu_model() or 'gpu')}"
    return config.directory / "trt-cache" / key


def trt_provider_options(config: ModelConfig, precision: str, max_batch: int, cache_dir: Path | None) -> dict[str, Any]:
    """The TensorRT provider's options for ``precision`` of ``config`` (see the module docstring).
    ``cache_dir`` None turns the engine caches off (a read-only model repository)."""
    lo, opt, hi = shape_profiles(config.inputs, max_batch, max(1, config.max_length))
    options: dict[str, Any] = {
        "trt_fp16_enable": precision == "fp16",
        "trt_int8_enable": precision == "int8" and is_qdq(config, precision),
        "trt_profile_min_shapes": lo,
        "trt_profile_opt_shapes": opt,
        "trt_profile_max_shapes": hi,
    }
    if cache_dir is not None:
        options.update({
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(cache_dir),
            # Timing caches make a rebuild for a new shape profile much faster.
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": str(cache_dir),
        })  # fmt: skip
    return options


def tensorrt_version() -> str | None:
    """The installed TensorRT libraries' version, from the wheel's metadata (no import)."""
    for dist in TRT_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_model() -> str | None:
    """The first NVIDIA GPU's model name from the driver's /proc files, or None."""
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    return None


def preload_for_onnxruntime() -> None:
    """Load the CUDA, cuDNN and TensorRT libraries of the nvidia pip wheels, once, so that
    ONNX Runtime's CUDA and TensorRT providers can start. Does nothing on a CPU build."""
    global _preloaded
    if _preloaded:
        return
    _preloaded = True
    import onnxruntime as ort

    if not hasattr(ort, "preload_dlls") or "CUDAExecutionProvider" not in ort.get_available_providers():
        return
    try:
        ort.preload_dlls()
    except (OSError, RuntimeError) as exc:
        log.warning("onnxruntime could not preload the CUDA libraries: %s", exc)
    if importlib.util.find_spec("tensorrt_libs") is not None:
        try:
            importlib.import_module("tensorrt_libs")  # loads libnvinfer & co. from the wheel
        except (OSError, ImportError) as exc:
            log.warning("the TensorRT libraries did not load: %s", exc)


def preload_for_ctranslate2() -> None:
    """CTranslate2's wheel is built against CUDA 12 and dlopens libcublas.so.12 by name: load
    it from the nvidia-cublas-cu12 wheel when that is installed (then the name resolves)."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for name in ("libcublasLt.so.12", "libcublas.so.12"):
            path = Path(root) / "cublas" / "lib" / name
            if path.is_file():
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()
