"""ModelRepository / ModelConfig parsing, on hand-made config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.repository import (
    ModelConfig,
    ModelConfigError,
    ModelNotFoundError,
    ModelRepository,
)


def config_dict(name: str = "tiny", version: str = "1") -> dict:
    return {
        "config_version": 1,
        "name": name,
        "version": version,
        "task": "text-embedding",
        "inputs": [
            {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
            {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]},
        ],
        "outputs": [{"name": "embedding", "dtype": "float32", "shape": ["batch", 4]}],
        "preprocessing_version": "text-test",
        "embedding_dim": 4,
        "max_length": 16,
        "tokenizer": "tokenizer.json",
        "variants": {
            "fp32": {"file": "model.fp32.onnx", "bytes": 10, "fidelity": {"reference": "torch"}},
            "int8": {"file": "model.int8.onnx", "bytes": 3, "fidelity": {"mean_cosine": 0.99}},
        },
        "build_key": "abc",
        "built_at": "2026-01-01T00:00:00+00:00",
    }


def write(root: Path, data: dict, version: str | None = None) -> Path:
    directory = root / data["name"] / (version or data["version"])
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(data))
    return directory


def test_resolve_parses_every_field(tmp_path: Path) -> None:
    directory = write(tmp_path, config_dict())
    config = ModelRepository(tmp_path).resolve("tiny", "1")
    assert config.name == "tiny" and config.version == "1" and config.directory == directory
    assert [t.name for t in config.inputs] == ["input_ids", "attention_mask"]
    assert config.inputs[0].dynamic_axes == {0: "batch", 1: "sequence"}
    assert config.outputs[0].shape == ("batch", 4)
    assert config.outputs[0].dynamic_axes == {0: "batch"}
    assert config.variant("int8").fidelity["mean_cosine"] == 0.99
    assert config.model_path("fp32") == directory / "model.fp32.onnx"
    assert config.tokenizer_path == directory / "tokenizer.json"
    assert (config.embedding_dim, config.max_length) == (4, 16)


def test_round_trip_through_to_dict(tmp_path: Path) -> None:
    data = config_dict()
    config = ModelConfig.from_dict(data, tmp_path)
    again = ModelConfig.from_dict(config.to_dict(), tmp_path)
    assert again == config
    assert config.to_dict()["variants"] == data["variants"]


def test_newest_version_is_numeric_not_lexicographic(tmp_path: Path) -> None:
    for v in ("2", "10", "9"):
        write(tmp_path, config_dict(version=v))
    assert ModelRepository(tmp_path).versions("tiny") == ["2", "9", "10"]
    assert ModelRepository(tmp_path).resolve("tiny").version == "10"


def test_incomplete_and_scratch_directories_are_ignored(tmp_path: Path) -> None:
    write(tmp_path, config_dict(version="1"))
    (tmp_path / "tiny" / "2").mkdir()  # no config.json yet: a build in progress
    write(tmp_path, config_dict(version="3"), version=".build-3-xyz")
    assert ModelRepository(tmp_path).resolve("tiny").version == "1"


def test_missing_model_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="mmstream models build"):
        ModelRepository(tmp_path).resolve("nope")
    write(tmp_path, config_dict())
    with pytest.raises(ModelNotFoundError, match="mmstream models build"):
        ModelRepository(tmp_path).resolve("tiny", "7")


def test_missing_precision_names_the_built_ones(tmp_path: Path) -> None:
    config = ModelConfig.from_dict(config_dict(), tmp_path)
    with pytest.raises(ModelNotFoundError, match="fp32, int8"):
        config.variant("fp16")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("embedding_dim"), "missing field 'embedding_dim'"),
        (lambda d: d.update(config_version=99), "config_version"),
        (lambda d: d.update(variants={}), "no variants"),
        (lambda d: d.update(max_length="long"), "invalid literal"),
        (lambda d: d["inputs"][0].pop("shape"), "missing field 'shape'"),
    ],
)
def test_bad_config_is_reported_with_its_path(tmp_path: Path, mutate, message: str) -> None:
    data = config_dict()
    mutate(data)
    write(tmp_path, data)
    with pytest.raises(ModelConfigError, match=message) as info:
        ModelRepository(tmp_path).resolve("tiny", "1")
    assert "config.json" in str(info.value)


def test_unreadable_json_and_mismatched_identity(tmp_path: Path) -> None:
    directory = write(tmp_path, config_dict())
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        ModelRepository(tmp_path).resolve("tiny", "1")
    write(tmp_path, config_dict(name="other"), version="2")  # lands in other/2
    (tmp_path / "other" / "2").rename(tmp_path / "tiny" / "2")
    with pytest.raises(ModelConfigError, match="describes other"):
        ModelRepository(tmp_path).resolve("tiny", "2")
