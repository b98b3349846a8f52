"""build_models' caching and atomic replacement, with a fake recipe (no torch)."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest

from workers.models import build as build_mod
from workers.models.build import BuildError, Recipe, build_models, ensure_built
from workers.repository import ModelConfig, ModelRepository, TensorSpec, VariantSpec


class FakeRecipe:
    """Writes a one-byte "model"; can be told to fail after writing part of it."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False
        self.payload = b"A"

    def __call__(self, out_dir: Path, key: str, log) -> ModelConfig:
        self.calls += 1
        (out_dir / "model.fp32.onnx").write_bytes(self.payload)
        if self.fail:
            raise RuntimeError("export crashed half way")
        (out_dir / "tokenizer.json").write_text("{}")
        return ModelConfig(
            name="fake", version="1", task="text-embedding",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "sequence")),),
            outputs=(TensorSpec("embedding", "float32", ("batch", 2)),),
            preprocessing_version="p", embedding_dim=2, max_length=4, tokenizer="tokenizer.json",
            variants=MappingProxyType({"fp32": VariantSpec("fp32", "model.fp32.onnx", 1, {"x": 1.0})}),
            build_key=key, built_at="2026-01-01T00:00:00+00:00", directory=out_dir,
        )


@pytest.fixture
def recipe(monkeypatch: pytest.MonkeyPatch) -> FakeRecipe:
    fake = FakeRecipe()
    monkeypatch.setattr(build_mod, "RECIPES", {"fake": Recipe("fake", "1", "numpy", fake)})
    monkeypatch.setattr(build_mod, "default_models", lambda: ["fake"])
    monkeypatch.setattr(build_mod, "_TOOLCHAIN", ("numpy",))
    return fake


def test_second_build_is_up_to_date(tmp_path: Path, recipe: FakeRecipe) -> None:
    logs: list[str] = []
    first = build_models(tmp_path, log=logs.append)
    second = build_models(tmp_path, log=logs.append)
    assert [r.status for r in first + second] == ["built", "up to date"]
    assert recipe.calls == 1
    assert second[0].fidelity == {"fp32": {"x": 1.0}}
    assert ModelRepository(tmp_path).resolve("fake").build_key == first[0].build_key
    assert "up to date" in logs[-1]


def test_force_and_a_new_key_rebuild(tmp_path: Path, recipe: FakeRecipe, monkeypatch) -> None:
    build_models(tmp_path, log=lambda _: None)
    assert build_models(tmp_path, force=True, log=lambda _: None)[0].status == "built"
    monkeypatch.setattr(build_mod, "EXPORTER_VERSION", "test-bump")
    assert build_models(tmp_path, log=lambda _: None)[0].status == "built"
    assert recipe.calls == 3


def test_failed_build_leaves_the_previous_version_intact(tmp_path: Path, recipe: FakeRecipe) -> None:
    build_models(tmp_path, log=lambda _: None)
    recipe.fail, recipe.payload = True, b"B"
    with pytest.raises(RuntimeError, match="half way"):
        build_models(tmp_path, force=True, log=lambda _: None)
    model_dir = tmp_path / "fake"
    assert (model_dir / "1" / "model.fp32.onnx").read_bytes() == b"A"
    assert sorted(p.name for p in model_dir.iterdir()) == [".lock", "1"]  # no scratch left


def test_leftovers_of_a_killed_build_are_cleaned(tmp_path: Path, recipe: FakeRecipe) -> None:
    stale = tmp_path / "fake" / ".build-1-dead"
    stale.mkdir(parents=True)
    (stale / "model.fp32.onnx").write_bytes(b"half")
    build_models(tmp_path, log=lambda _: None)
    assert not stale.exists()


def test_missing_file_triggers_a_rebuild(tmp_path: Path, recipe: FakeRecipe) -> None:
    build_models(tmp_path, log=lambda _: None)
    (tmp_path / "fake" / "1" / "tokenizer.json").unlink()
    assert ensure_built(tmp_path, "fake", log=lambda _: None).tokenizer_path.is_file()
    assert recipe.calls == 2


def test_unknown_model(tmp_path: Path, recipe: FakeRecipe) -> None:
    with pytest.raises(BuildError, match="unknown models \\['nope'\\]; known: \\['fake'\\]"):
        build_models(tmp_path, ["nope"])


def test_build_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, workers.models.build; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_key_sees_the_code_but_not_its_comments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe whose code changed rebuilds; one whose comments changed does not."""
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "mm_fake_recipe_mod.py"
    recipe = Recipe("fake", "1", "numpy", lambda *a: None, ("mm_fake_recipe_mod",))
    monkeypatch.setattr(build_mod, "_TOOLCHAIN", ("numpy",))
    keys = []
    for text in ("GATE = 0.9\n", "# a comment\nGATE = 0.9  # why\n", "GATE = 0.8\n"):
        source.write_text(text)
        keys.append(build_mod.build_key(recipe))
    assert keys[0] == keys[1] != keys[2]
    assert build_mod.code_digest(("mm_no_such_module",)) != build_mod.code_digest(("mm_fake_recipe_mod",))
