"""The fidelity gate as pure code, and the fallback it drives in ``load_engine``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import MappingProxyType

import pytest

from workers.engines import EngineError, EngineOptions, load_engine
from workers.engines.gate import (
    FALLBACK_REASONS,
    check_provider,
    check_variant,
    fallback_chain,
    gate_failures,
    on_gpu,
)
from workers.repository import ModelConfig, VariantSpec

from .test_onnx_engine import tiny_model

pytest.importorskip("onnx")
CPU = EngineOptions(intra_op_threads=1, providers=("CPUExecutionProvider",))


class Recorder:
    """An ``Observer`` that keeps what it is told."""

    def __init__(self) -> None:
        self.fallbacks: list[tuple[str, str, str, str]] = []
        self.engines: list[tuple[str, dict]] = []

    def engine_fallback(self, stage: str, from_: str, to: str, reason: str) -> None:
        assert reason in FALLBACK_REASONS
        self.fallbacks.append((stage, from_, to, reason))

    def set_engine(self, stage: str, info: dict) -> None:
        self.engines.append((stage, dict(info)))

    def cache_lookup(self, modality: str, result: str) -> None:
        pass


def with_variants(tmp_path: Path, **variants: dict) -> ModelConfig:
    """``tiny_model`` plus extra variants (a copy of the fp32 graph unless ``copy`` is False),
    config.json written."""
    tiny_model(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for precision, spec in variants.items():
        spec = {"file": f"model.{precision}.onnx", "bytes": 1, "fidelity": {}, **spec}
        if spec.pop("copy", True):
            shutil.copyfile(tmp_path / "model.fp32.onnx", tmp_path / spec["file"])
        data["variants"][precision] = spec
    (tmp_path / "config.json").write_text(json.dumps(data))
    return ModelConfig.from_dict(data, tmp_path)


# -- pure -------------------------------------------------------------------------------

def test_thresholds_hold_or_name_what_they_miss() -> None:
    fidelity = {"mean_cosine": 0.995, "wer": 0.08, "flag": True, "note": "x"}
    assert gate_failures(fidelity, {"mean_cosine": {"min": 0.99}, "wer": {"max": 0.1}}) == []
    assert gate_failures(fidelity, {"mean_cosine": {"min": 0.999, "max": 1.0}}) == ["mean_cosine 0.995 < 0.999"]
    assert gate_failures(fidelity, {"wer": {"max": 0.05}}) == ["wer 0.08 > 0.05"]
    assert gate_failures(fidelity, {"top1_agreement": {"min": 0.9}, "flag": {"min": 0}, "note": {"min": 0}}) == [
        "top1_agreement was not measured", "flag was not measured", "note was not measured"]
    assert gate_failures({}, {}) == []
    with pytest.raises(ValueError, match="only min and max"):
        gate_failures(fidelity, {"mean_cosine": {"minimum": 0.9}})


def test_the_chain_is_the_request_then_the_reference() -> None:
    assert fallback_chain("fp16") == ("fp16", "fp32")
    assert fallback_chain("int8") == ("int8", "fp32")
    assert fallback_chain("fp32") == ("fp32",)


def test_a_variant_is_refused_when_missing_or_under_its_gate() -> None:
    gated = VariantSpec("int8", "m.onnx", 1, MappingProxyType({"mean_cosine": 0.97}),
                        MappingProxyType({"mean_cosine": MappingProxyType({"min": 0.98})}))
    ungated = VariantSpec("fp32", "m.onnx", 1)
    config = ModelConfig("m", "3", "text-embedding", (), (), "p", 4, 8, "t", MappingProxyType(
        {"int8": gated, "fp32": ungated}), "k", "now")
    assert check_variant(config, "fp32") is None  # a build without thresholds passes
    refusal = check_variant(config, "int8")
    assert (refusal.precision, refusal.reason) == ("int8", "fidelity")
    assert "m/3 int8 misses its gate: mean_cosine 0.97 < 0.98" in refusal.detail
    assert check_variant(config, "fp16").reason == "missing"
    assert "built: fp32, int8" in check_variant(config, "fp16").detail


def test_gpu_only_precisions_are_refused_on_the_cpu() -> None:
    assert check_provider("fp16", "CPUExecutionProvider").reason == "provider"
    assert check_provider("fp16", "cpu/float16").reason == "provider"
    assert check_provider("fp16", "CUDAExecutionProvider") is None
    assert check_provider("fp16", "TensorrtExecutionProvider") is None
    assert check_provider("int8", "CPUExecutionProvider") is None
    assert on_gpu("cuda/int8_float16") and not on_gpu("cpu/int8")


def test_gates_survive_config_json(tmp_path: Path) -> None:
    config = with_variants(tmp_path, int8={"fidelity": {"mean_cosine": 0.99}, "gate": {"mean_cosine": {"min": 0.98}}})
    assert dict(config.variant("int8").gate["mean_cosine"]) == {"min": 0.98}
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())), tmp_path)
    assert again.variant("int8").gate == config.variant("int8").gate
    assert "gate" not in config.to_dict()["variants"]["fp32"]  # ungated variants write what they wrote before


# -- the fallback in load_engine --------------------------------------------------------

def test_a_variant_under_its_gate_falls_back_to_fp32_and_is_counted(tmp_path: Path, caplog) -> None:
    config = with_variants(tmp_path, int8={"fidelity": {"mean_cosine": 0.9}, "gate": {"mean_cosine": {"min": 0.98}}})
    seen = Recorder()
    engine = load_engine(config, "int8", CPU, stage="encode.text", observer=seen)
    assert engine.precision == "fp32" and engine.info.precision == "fp32"
    assert seen.fallbacks == [("encode.text", "int8", "fp32", "fidelity")]
    assert "refusing int8 (fidelity): tiny/1 int8 misses its gate: mean_cosine 0.9 < 0.98; falling back to fp32" \
        in caplog.text


def test_a_passing_variant_is_served_with_nothing_counted(tmp_path: Path) -> None:
    config = with_variants(tmp_path, int8={"fidelity": {"mean_cosine": 0.99}, "gate": {"mean_cosine": {"min": 0.98}}})
    seen = Recorder()
    assert load_engine(config, "int8", CPU, stage="encode.text", observer=seen).precision == "int8"
    assert seen.fallbacks == []


def test_fp16_on_the_cpu_falls_back_with_reason_provider(tmp_path: Path) -> None:
    seen = Recorder()
    engine = load_engine(with_variants(tmp_path, fp16={}), "fp16", CPU, stage="encode.image", observer=seen)
    assert engine.precision == "fp32"
    assert seen.fallbacks == [("encode.image", "fp16", "fp32", "provider")]


def test_a_variant_that_does_not_load_falls_back_with_reason_load_failed(tmp_path: Path) -> None:
    seen = Recorder()
    config = with_variants(tmp_path, int8={"copy": False})  # in config.json, file never written
    assert load_engine(config, "int8", CPU, stage="encode.text", observer=seen).precision == "fp32"
    assert seen.fallbacks == [("encode.text", "int8", "fp32", "load_failed")]
    assert load_engine(config, "fp16", CPU, stage="s", observer=seen).precision == "fp32"  # never built
    assert seen.fallbacks[-1] == ("s", "fp16", "fp32", "missing")


def test_nothing_servable_is_one_error_naming_every_reason(tmp_path: Path) -> None:
    config = with_variants(tmp_path, int8={"fidelity": {"mean_cosine": 0.5}, "gate": {"mean_cosine": {"min": 0.98}}})
    (tmp_path / "model.fp32.onnx").unlink()
    seen = Recorder()
    with pytest.raises(EngineError, match=r"no variant of tiny/1 can be served: .*mean_cosine 0.5 < 0.98.*fp32 did not load"):
        load_engine(config, "int8", CPU, stage="encode.text", observer=seen)
    assert seen.fallbacks == [("encode.text", "int8", "fp32", "fidelity"), ("encode.text", "fp32", "none", "load_failed")]
