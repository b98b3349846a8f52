"""OnnxEngine on a tiny hand-built graph: provider choice, feeds, warm-up, errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from workers.engines.onnx import EngineError, OnnxEngine
from workers.repository import ModelConfig, ModelNotFoundError

onnx = pytest.importorskip("onnx")  # only to write the test graph; the engine does not need it


def tiny_model(tmp_path: Path) -> ModelConfig:
    """embedding = attention_mask (as float) @ W, W = ones(1, 4): a [batch, 4] output."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["mask_f"], ["count"], keepdims=1),
            helper.make_node("MatMul", ["count", "w"], ["embedding"]),
        ],
        "tiny",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("w", TensorProto.FLOAT, [1, 4], [1.0, 2.0, 3.0, 4.0])],
    )
    # ReduceSum over axis 1 needs the axes input (opset 13+); keep it simple with opset 11.
    graph.node[1].attribute.append(helper.make_attribute("axes", [1]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    # input_ids is declared but unused: ONNX allows it, and it mirrors the real model's inputs.
    onnx.save_model(model, str(tmp_path / "model.fp32.onnx"))
    config = {
        "config_version": 1, "name": "tiny", "version": "1", "task": "text-embedding",
        "inputs": [
            {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
            {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]},
        ],
        "outputs": [{"name": "embedding", "dtype": "float32", "shape": ["batch", 4]}],
        "preprocessing_version": "t", "embedding_dim": 4, "max_length": 8,
        "tokenizer": "tokenizer.json",
        "variants": {"fp32": {"file": "model.fp32.onnx", "bytes": 1, "fidelity": {}}},
        "build_key": "k", "built_at": "2026-01-01T00:00:00+00:00",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dict(config, tmp_path)


def test_runs_and_reports_the_cpu_provider(tmp_path: Path) -> None:
    engine = OnnxEngine(tiny_model(tmp_path), "fp32", intra_op_threads=1)
    info = engine.load()
    # TensorRT and CUDA are asked for first; this CPU build of onnxruntime skips them.
    assert (info.model, info.version, info.precision, info.backend) == ("tiny", "1", "fp32", "onnxruntime")
    assert info.provider in ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider")
    mask = np.array([[1, 1, 0], [1, 1, 1]], dtype=np.int64)
    out = engine.run({"input_ids": np.zeros_like(mask), "attention_mask": mask})
    np.testing.assert_allclose(out["embedding"], [[2, 4, 6, 8], [3, 6, 9, 12]])


def test_cpu_only_provider_list(tmp_path: Path) -> None:
    engine = OnnxEngine(tiny_model(tmp_path), "fp32", providers=("CPUExecutionProvider",))
    assert engine.load().provider == "CPUExecutionProvider"


def test_no_available_provider_is_a_clear_error(tmp_path: Path) -> None:
    engine = OnnxEngine(tiny_model(tmp_path), "fp32", providers=("NoSuchExecutionProvider",))
    with pytest.raises(EngineError, match="none of the providers"):
        engine.load()


def test_unbuilt_precision_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no 'int8' variant"):
        OnnxEngine(tiny_model(tmp_path), "int8")


def test_run_before_load_and_missing_inputs(tmp_path: Path) -> None:
    engine = OnnxEngine(tiny_model(tmp_path), "fp32")
    with pytest.raises(EngineError, match="not loaded"):
        engine.run({})
    with pytest.raises(EngineError, match="not loaded"):
        engine.info
    engine.load()
    with pytest.raises(EngineError, match="missing inputs \\['attention_mask'\\]"):
        engine.run({"input_ids": np.zeros((1, 2), dtype=np.int64)})


def test_missing_model_file(tmp_path: Path) -> None:
    config = tiny_model(tmp_path)
    (tmp_path / "model.fp32.onnx").unlink()
    with pytest.raises(EngineError, match="is missing"):
        OnnxEngine(config, "fp32").load()


def test_warmup_uses_synthetic_feeds_from_the_config(tmp_path: Path) -> None:
    engine = OnnxEngine(tiny_model(tmp_path), "fp32")
    engine.load()
    feeds = engine.synthetic_feeds(batch=3, length=5)
    assert {k: (v.shape, v.dtype) for k, v in feeds.items()} == {
        "input_ids": ((3, 5), np.int64),
        "attention_mask": ((3, 5), np.int64),
    }
    seconds = engine.warmup(n=4)
    assert len(seconds) == 4 and all(s >= 0 for s in seconds)


def test_concurrent_callers_are_serialized_and_correct(tmp_path: Path) -> None:
    engine = OnnxEngine(tiny_model(tmp_path), "fp32", intra_op_threads=1)
    engine.load()
    errors: list[BaseException] = []

    def call(n: int) -> None:
        try:
            mask = np.ones((2, n), dtype=np.int64)
            out = engine.run({"input_ids": mask, "attention_mask": mask})["embedding"]
            np.testing.assert_allclose(out[:, 0], [n, n])
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
