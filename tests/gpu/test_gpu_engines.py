"""The engines on a real GPU (``-m gpu``; infra/gpu/check.sh runs these after `make gpu-setup`).

Every test here skips, saying why, where onnxruntime has no CUDA provider or no GPU is
visible: a CPU machine (CI) runs none of them and stays green.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from schemas.settings import Settings
from workers.engines import EngineOptions, load_engine
from workers.repository import ModelRepository

ort = pytest.importorskip("onnxruntime")


def _gpu_visible() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0


NO_CUDA = "CUDAExecutionProvider" not in ort.get_available_providers()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NO_CUDA, reason="this onnxruntime has no CUDA provider (CPU build): run `make gpu-setup`"),
    pytest.mark.skipif(not NO_CUDA and not _gpu_visible(), reason="no NVIDIA GPU visible (nvidia-smi -L)"),
]
CUDA = EngineOptions(providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
TRT = EngineOptions(providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"))


@pytest.fixture(scope="module")
def repo() -> ModelRepository:
    return ModelRepository(Settings.from_env().models.repository)


def _embed(engine, n: int = 4) -> np.ndarray:
    feeds = engine.synthetic_feeds(batch=n, length=16)
    return next(iter(engine.run(feeds).values()))


@pytest.mark.parametrize("model", ["all-minilm-l6-v2", "efficientnet-lite0"])
def test_fp32_on_cuda_matches_the_cpu(repo, model: str) -> None:
    config = repo.resolve(model)
    gpu = load_engine(config, "fp32", CUDA)
    cpu = load_engine(config, "fp32", EngineOptions(providers=("CPUExecutionProvider",)))
    assert gpu.info.provider == "CUDAExecutionProvider"
    a, b = _embed(gpu), _embed(cpu)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.9999


@pytest.mark.parametrize("model", ["all-minilm-l6-v2", "efficientnet-lite0"])
def test_fp16_is_served_on_the_gpu_when_built_and_gated(repo, model: str) -> None:
    config = repo.resolve(model)
    if "fp16" not in config.variants:
        pytest.skip(f"{model} has no fp16 variant: mmstream models build --target gpu")
    engine = load_engine(config, "fp16", CUDA)
    assert (engine.precision, engine.info.provider) == ("fp16", "CUDAExecutionProvider")


def test_tensorrt_builds_and_caches_its_engine(repo, tmp_path) -> None:
    config = repo.resolve("all-minilm-l6-v2")
    engine = load_engine(config, "fp32", TRT, trt_cache_dir=tmp_path)
    if engine.info.provider != "TensorrtExecutionProvider":
        pytest.skip(f"TensorRT did not start (runs on {engine.info.provider}): its libraries are not installed")
    _embed(engine)
    assert any(tmp_path.iterdir()), "no engine or timing cache written"


def test_the_lm_runs_on_cuda(repo) -> None:
    engine = load_engine(repo.resolve("smollm2-135m"), "fp32", CUDA)
    assert engine.info.provider == "CUDAExecutionProvider"
    assert len(engine.generate_greedy([1, 2, 3, 4], 4)) >= 1


def test_whisper_runs_on_cuda(repo) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    if ctranslate2.get_cuda_device_count() == 0:
        pytest.skip("CTranslate2 sees no CUDA device (is nvidia-cublas-cu12 installed?)")
    engine = load_engine(repo.resolve("whisper-base"), "int8", CUDA)
    assert engine.info.provider == "cuda/int8_float16"
    assert np.asarray(engine.run(np.zeros((1, 80, 3000), np.float32))).shape == (1, 1500, 512)
