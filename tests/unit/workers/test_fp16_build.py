"""`models build --target gpu`'s fp16 step on a tiny graph: converted, measured, recorded with
its gate, config.json replaced whole; up to date the second time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.models import fp16, gates
from workers.models.build import BuildError, build_models
from workers.repository import ModelRepository

from .test_onnx_engine import tiny_model

onnx = pytest.importorskip("onnx")


def test_fp16_is_built_measured_gated_and_then_up_to_date(tmp_path: Path, monkeypatch) -> None:
    version_dir = tmp_path / "tiny" / "1"
    version_dir.mkdir(parents=True)
    config = tiny_model(version_dir)
    calls = []
    monkeypatch.setitem(fp16.PROBES, "text-embedding", lambda c, a, b: calls.append((a.name, b.name)) or {"mean_cosine": 0.9999})
    monkeypatch.setitem(gates.GATES, "tiny", {"fp16": {"mean_cosine": {"min": 0.999}}})
    lines: list[str] = []
    built = fp16.ensure_fp16(config, lines.append)
    assert calls == [("model.fp32.onnx", "model.fp16.onnx")]
    graph = onnx.load(str(version_dir / "model.fp16.onnx")).graph
    assert {i.data_type for i in graph.initializer} == {onnx.TensorProto.FLOAT16}
    assert [i.type.tensor_type.elem_type for i in graph.output] == [onnx.TensorProto.FLOAT]  # io kept float32
    on_disk = ModelRepository(tmp_path).resolve("tiny", "1")
    variant = on_disk.variant("fp16")
    assert variant == built.variant("fp16")
    assert variant.fidelity["mean_cosine"] == 0.9999 and variant.fidelity["recipe"] == fp16.recipe_key()
    assert dict(variant.gate["mean_cosine"]) == {"min": 0.999}
    assert not list(version_dir.glob(".*.tmp"))
    again = fp16.ensure_fp16(on_disk, lines.append)
    assert again is on_disk and len(calls) == 1  # up to date: nothing converted or measured


def test_models_without_a_probe_are_left_alone(tmp_path: Path) -> None:
    config = tiny_model(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    lines: list[str] = []
    whisper = config.from_dict({**data, "task": "audio-embedding+transcription", "backend": "ctranslate2"}, tmp_path)
    assert fp16.ensure_fp16(whisper, lines.append) is whisper
    assert "no fp16 variant for a ctranslate2" in lines[0]


def test_an_unknown_target_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="unknown build target 'tpu'; targets: cpu, gpu"):
        build_models(tmp_path, ["all-minilm-l6-v2"], target="tpu")
