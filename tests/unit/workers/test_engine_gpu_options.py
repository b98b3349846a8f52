"""TensorRT provider options, shape profiles and cache keys: pure, checked on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engines import gpu
from workers.engines.onnx import OnnxEngine
from workers.repository import TensorSpec

from .test_engine_gate import with_variants

pytest.importorskip("onnx")


def test_shape_profiles_cover_batch_one_to_max_and_every_length() -> None:
    text = (TensorSpec("input_ids", "int64", ("batch", "sequence")), TensorSpec("attention_mask", "int64", ("batch", "sequence")))
    assert gpu.shape_profiles(text, 16, 256) == (
        "input_ids:1x1,attention_mask:1x1", "input_ids:8x64,attention_mask:8x64", "input_ids:16x256,attention_mask:16x256")
    image = (TensorSpec("pixels", "float32", ("batch", 3, 224, 224)),)
    assert gpu.shape_profiles(image, 1, 1) == ("pixels:1x3x224x224",) * 3
    with pytest.raises(ValueError):
        gpu.shape_profiles(image, 0, 8)


def test_precision_flags_follow_the_variant(tmp_path: Path) -> None:
    config = with_variants(tmp_path, fp16={}, int8={"fidelity": {"quantization": "static QDQ: int8 per-channel"}})
    cache = tmp_path / "cache"
    fp32 = gpu.trt_provider_options(config, "fp32", 16, cache)
    assert (fp32["trt_fp16_enable"], fp32["trt_int8_enable"]) == (False, False)  # fp32 stays fp32
    assert gpu.trt_provider_options(config, "fp16", 16, cache)["trt_fp16_enable"] is True
    assert gpu.trt_provider_options(config, "int8", 16, cache)["trt_int8_enable"] is True  # Q/DQ: explicit int8
    assert fp32["trt_engine_cache_path"] == fp32["trt_timing_cache_path"] == str(cache)
    assert fp32["trt_profile_max_shapes"] == "input_ids:16x8,attention_mask:16x8"  # tiny max_length 8
    assert "trt_engine_cache_enable" not in gpu.trt_provider_options(config, "fp32", 16, None)


def test_dynamic_int8_does_not_ask_tensorrt_for_int8(tmp_path: Path) -> None:
    config = with_variants(tmp_path, int8={"fidelity": {"quantization": "dynamic int8, per-channel weights"}})
    assert gpu.trt_provider_options(config, "int8", 16, None)["trt_int8_enable"] is False


def test_the_cache_is_keyed_by_precision_runtime_tensorrt_and_gpu(tmp_path: Path, monkeypatch) -> None:
    import onnxruntime as ort

    config = with_variants(tmp_path, fp16={})
    monkeypatch.setattr(gpu, "tensorrt_version", lambda: "10.16.1.11")
    monkeypatch.setattr(gpu, "gpu_model", lambda: "NVIDIA H200 (141 GB)")
    path = gpu.trt_cache_dir(config, "fp16")
    assert path == tmp_path / "trt-cache" / f"fp16-ort{ort.__version__}-trt10.16.1.11-nvidia-h200-141-gb"
    assert gpu.trt_cache_dir(config, "fp32") != path


def test_a_read_only_repository_serves_without_an_engine_cache(tmp_path: Path, caplog) -> None:
    config = with_variants(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    engine = OnnxEngine(config, "fp32", trt_cache_dir=blocker / "cannot-exist", max_batch=4)
    options = engine._provider_options("TensorrtExecutionProvider")
    assert "trt_engine_cache_path" not in options and options["trt_profile_max_shapes"].startswith("input_ids:4x")
    assert "no TensorRT engine cache" in caplog.text
    assert engine._provider_options("CUDAExecutionProvider") == {"device_id": 0}
