"""The engine seam: backends by name, imported on first use, each keeping the ``Engine`` contract.

The ONNX Runtime and LM backends run here on tiny hand-built graphs; Whisper (CTranslate2)
is checked on the real model where tests/integration/test_audio_model.py loads it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas.settings import Settings
from workers.engines import (
    BACKENDS,
    DEFAULT_PROVIDERS,
    Engine,
    EngineError,
    EngineOptions,
    engine_class,
    load_engine,
    parse_providers,
)
from workers.repository import ModelConfig

from .test_onnx_engine import tiny_model

onnx = pytest.importorskip("onnx")
REPO = Path(__file__).resolve().parents[3]
CPU = EngineOptions(intra_op_threads=1, providers=("CPUExecutionProvider",))


def tiny_config_dict(tmp_path: Path) -> dict:
    """config.json of ``tiny_model`` (an ONNX embedding model), as a dict to vary."""
    tiny_model(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def tiny_lm(tmp_path: Path) -> ModelConfig:
    """A 4-token "LM" in the smollm graph's shape (1 layer, 1 KV head, head_dim 2): the next
    token after id t is (t + 1) % 4, and new_kv repeats each new token id. Token 3 ends a turn."""
    from onnx import TensorProto, helper

    def const(name: str, values: list[int]) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)

    nodes = [
        helper.make_node("Slice", ["input_ids", "minus1", "big", "one"], ["last2d"]),  # ids[:, -1:]
        helper.make_node("Squeeze", ["last2d", "one"], ["last"]),
        helper.make_node("Gather", ["table", "last"], ["logits"], axis=0),
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_f", "kv_axes"], ["ids6"]),  # [1, 1, b, 1, new, 1]
        helper.make_node("Expand", ["ids6", "kv_shape"], ["new_kv"]),
    ]
    table = np.roll(np.eye(4, dtype=np.float32), 1, axis=1)  # row t is one-hot at (t + 1) % 4
    graph = helper.make_graph(
        nodes, "tiny-lm",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "new"]),
            helper.make_tensor_value_info("past_kv", TensorProto.FLOAT, [1, 2, "batch", 1, "past", 2]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, [1, 2, "batch", 1, "new", 2]),
        ],
        [
            helper.make_tensor("table", TensorProto.FLOAT, [4, 4], table.flatten().tolist()),
            const("minus1", [-1]), const("big", [1 << 30]), const("one", [1]),
            const("kv_axes", [0, 1, 3, 5]), const("kv_shape", [1, 2, 1, 1, 1, 2]),
        ],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "model.fp32.onnx"))
    (tmp_path / "generation.json").write_text(json.dumps(
        {"layers": 1, "kv_heads": 1, "head_dim": 2, "eos_token_ids": [3], "max_context": 64}))
    return ModelConfig.from_dict({
        "config_version": 1, "name": "tiny-lm", "version": "1", "task": "text-generation",
        "inputs": [], "outputs": [], "preprocessing_version": "t", "embedding_dim": 0, "max_length": 64,
        "tokenizer": "tokenizer.json", "backend": "lm-onnxruntime",
        "variants": {"fp32": {"file": "model.fp32.onnx", "bytes": 1, "fidelity": {}}},
        "build_key": "k", "built_at": "2026-01-01T00:00:00+00:00",
    }, tmp_path)  # fmt: skip


def test_each_backend_module_is_imported_only_when_asked_for() -> None:
    code = (
        "import sys, workers.engines as e\n"
        "mods = ('workers.engines.onnx', 'workers.engines.ctranslate2', 'workers.engines.lm', 'onnxruntime', 'ctranslate2')\n"
        "assert not [m for m in mods if m in sys.modules], [m for m in mods if m in sys.modules]\n"
        "cls = e.engine_class('ctranslate2')\n"
        "assert cls.__name__ == 'WhisperEngine' and 'workers.engines.ctranslate2' in sys.modules\n"
        "assert 'workers.engines.onnx' not in sys.modules and 'workers.engines.lm' not in sys.modules\n"
        "assert e.engine_class('onnxruntime').__name__ == 'OnnxEngine'\n"
        "assert 'workers.engines.lm' not in sys.modules\n"
        "assert e.engine_class('lm-onnxruntime').__name__ == 'LMEngine'\n"
        "assert 'llama_cpp' not in sys.modules\n"
        "assert e.engine_class('llama-cpp').__name__ == 'LlamaEngine' and 'llama_cpp' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_registered_backend_resolves_to_a_class_of_that_backend() -> None:
    assert set(BACKENDS) == {"onnxruntime", "ctranslate2", "lm-onnxruntime", "llama-cpp"}
    for name in BACKENDS:
        cls = engine_class(name)
        assert cls.backend == name
        for member in ("from_options", "load", "info", "warmup", "run"):
            assert hasattr(cls, member), f"{cls.__name__} lacks {member}"


def test_an_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(EngineError, match=r"unknown engine backend 'tensorrt-native'; known: ctranslate2, llama-cpp, lm-onnxruntime, onnxruntime"):
        engine_class("tensorrt-native")


def test_the_config_names_the_backend_and_old_configs_get_theirs_inferred(tmp_path: Path) -> None:
    data = tiny_config_dict(tmp_path)
    assert ModelConfig.from_dict(data, tmp_path).backend == "onnxruntime"
    whisper = {**data, "variants": {"int8": {"file": "ct2/model.bin", "bytes": 1}}}
    assert ModelConfig.from_dict(whisper, tmp_path).backend == "ctranslate2"
    assert ModelConfig.from_dict({**data, "task": "text-generation"}, tmp_path).backend == "lm-onnxruntime"
    named = ModelConfig.from_dict({**data, "backend": "ctranslate2"}, tmp_path)
    assert named.backend == "ctranslate2" and named.to_dict()["backend"] == "ctranslate2"


def test_onnx_backend_keeps_the_contract(tmp_path: Path) -> None:
    engine = load_engine(tiny_model(tmp_path), "fp32", CPU)
    assert isinstance(engine, Engine)
    assert engine.info.backend == "onnxruntime" and engine.info.provider == "CPUExecutionProvider"
    assert len(engine.warmup(2)) == 2
    mask = np.ones((3, 2), np.int64)
    assert engine.run({"input_ids": mask, "attention_mask": mask})["embedding"].shape == (3, 4)


def test_lm_backend_keeps_the_contract(tmp_path: Path) -> None:
    config = tiny_lm(tmp_path)
    engine = engine_class(config.backend).from_options(config, "fp32", CPU)
    with pytest.raises(EngineError, match="not loaded"):
        engine.info
    info = engine.load()
    assert isinstance(engine, Engine)
    assert (info.model, info.precision, info.provider, info.backend) == (
        "tiny-lm", "fp32", "CPUExecutionProvider", "lm-onnxruntime")
    assert len(engine.warmup(2)) == 2
    assert engine.generate_greedy([0], 8) == [1, 2, 3]  # stops at the end-of-turn id
    from workers.engines.lm import SamplingParams

    seqs = [engine.new_sequence(str(i), [i, i], SamplingParams(max_tokens=2)) for i in range(2)]
    logits = engine.run([(s, 2) for s in seqs])  # one logits row per chunk
    assert logits.shape == (2, 4) and list(logits.argmax(1)) == [1, 2]


def test_lm_backend_never_asks_for_tensorrt(tmp_path: Path) -> None:
    engine = load_engine(tiny_lm(tmp_path), "fp32", EngineOptions(providers=DEFAULT_PROVIDERS))
    assert "TensorrtExecutionProvider" not in engine.providers
    assert engine.info.provider in ("CUDAExecutionProvider", "CPUExecutionProvider")


def test_options_come_from_the_encoder_settings() -> None:
    s = Settings.from_env({"MMSTREAM_ENCODER_PROVIDERS": "cuda, cpu", "MMSTREAM_ENCODER_INTRA_OP_THREADS": "3",
                           "MMSTREAM_ENCODER_MAX_BATCH_SIZE": "8"})
    assert EngineOptions.from_settings(s.encoder) == EngineOptions(
        intra_op_threads=3, providers=("CUDAExecutionProvider", "CPUExecutionProvider"), max_batch=8)
    assert EngineOptions.from_settings(Settings().encoder).providers == DEFAULT_PROVIDERS


def test_provider_lists_take_aliases_and_full_names() -> None:
    assert parse_providers("TensorRT,cuda,CPUExecutionProvider,cpu") == DEFAULT_PROVIDERS
    with pytest.raises(ValueError, match="unknown provider 'gpu'"):
        parse_providers("gpu,cpu")
    with pytest.raises(ValueError, match="empty"):
        parse_providers(" , ")


def test_whisper_backend_runs_on_the_cpu_without_cuda_in_the_provider_list(tmp_path: Path) -> None:
    cls = engine_class("ctranslate2")
    whisper = {**tiny_config_dict(tmp_path), "variants": {"int8": {"file": "ct2/model.bin", "bytes": 1}}}
    config = ModelConfig.from_dict(whisper, tmp_path)
    assert cls.from_options(config, "int8", CPU).device == "cpu"
    assert cls.from_options(config, "int8", EngineOptions()).device == "auto"
    with pytest.raises(EngineError, match="is missing"):  # the contract's load error, before any runtime work
        cls.from_options(config, "int8", CPU).load()


def test_each_variant_is_served_by_its_own_backend(tmp_path: Path) -> None:
    """A GGUF variant beside ONNX graphs names llama.cpp; the others keep the model's."""
    data = {**tiny_config_dict(tmp_path), "task": "text-generation", "backend": "lm-onnxruntime"}
    data["variants"] = {"fp32": {"file": "model.fp32.onnx", "bytes": 1},
                        "q4_1": {"file": "model.q4_1.gguf", "bytes": 1, "backend": "llama-cpp"}}
    config = ModelConfig.from_dict(data, tmp_path)
    assert (config.backend_of("fp32"), config.backend_of("q4_1")) == ("lm-onnxruntime", "llama-cpp")
    assert config.to_dict()["variants"]["q4_1"]["backend"] == "llama-cpp"
    assert "backend" not in config.to_dict()["variants"]["fp32"]
