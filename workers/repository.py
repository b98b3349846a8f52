"""The model repository on disk: configuration as data, one directory per model version.

Layout::

    <root>/<name>/<version>/config.json        what the model is (see ``ModelConfig``)
    <root>/<name>/<version>/model.fp32.onnx    one file per precision variant
    <root>/<name>/<version>/model.int8.onnx
    <root>/<name>/<version>/tokenizer.json     preprocessing assets named by the config

Versions are positive integers so "newest" is unambiguous. Entries whose name starts with a
dot are a builder's scratch space and are never resolved; ``config.json`` is written last,
so a version directory without it is incomplete and is skipped as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

CONFIG_FILE = "config.json"
CONFIG_VERSION = 1  # layout of config.json itself; bump when a field changes meaning


class ModelRepositoryError(Exception):
    """Root of the model repository's errors."""

    code = "internal"
    retriable = False


class ModelNotFoundError(ModelRepositoryError):
    """The repository has no built version of the model (or of the precision) asked for."""


class ModelConfigError(ModelRepositoryError):
    """A config.json exists but does not describe a usable model."""


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output.

    ``shape`` lists each axis as a fixed size (int) or the name of a dynamic axis (str),
    e.g. ``("batch", "sequence")`` or ``("batch", 384)``.
    """

    name: str
    dtype: str  # numpy dtype name: "int64", "float32", ...
    shape: tuple[int | str, ...]

    @property
    def dynamic_axes(self) -> dict[int, str]:
        """Axis index -> axis name, for the axes whose size is chosen per call."""
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class VariantSpec:
    """One precision variant of a model: its file and how far it drifts from its reference.

    ``fidelity`` is measured at build time, e.g. ``{"reference": "fp32", "mean_cosine":
    0.998, "min_cosine": 0.99}``. ``gate`` holds the thresholds it must meet to be served,
    e.g. ``{"mean_cosine": {"min": 0.99}}`` (``workers.engines.gate`` reads both; builds from
    before the gate have none). The engine reads neither.
    """

    precision: str  # "fp32", "int8", ...
    file: str  # relative to the version directory
    bytes: int
    fidelity: Mapping[str, Any] = field(default_factory=dict)
    gate: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    backend: str = ""  # the engine serving this variant when it is not the model's (a GGUF beside ONNX graphs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "bytes": self.bytes, "fidelity": dict(self.fidelity)}
        if self.backend:
            out["backend"] = self.backend
        if self.gate:
            out["gate"] = {metric: dict(bounds) for metric, bounds in self.gate.items()}
        return out


@dataclass(frozen=True)
class ModelConfig:
    """Everything a worker needs to know about one built model version.

    ``directory`` is where the version lives; it is not stored in config.json (the
    directory may move) but filled in by ``ModelRepository.resolve``.
    """

    name: str
    version: str
    task: str  # "text-embedding", ...
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    preprocessing_version: str
    embedding_dim: int
    max_length: int  # most tokens per input, special tokens included; longer inputs are truncated
    tokenizer: str  # file name inside the version directory
    variants: Mapping[str, VariantSpec]
    build_key: str
    built_at: str  # ISO 8601, UTC
    source: Mapping[str, Any] = field(default_factory=dict)  # where the weights came from, license
    directory: Path = Path(".")
    backend: str = "onnxruntime"  # which engine serves it: a name in ``workers.engines.BACKENDS``

    def variant(self, precision: str) -> VariantSpec:
        """The variant for ``precision``; raises ``ModelNotFoundError`` naming those built."""
        try:
            return self.variants[precision]
        except KeyError:
            raise ModelNotFoundError(
                f"{self.name} version {self.version} has no {precision!r} variant "
                f"(built: {', '.join(sorted(self.variants))})"
            ) from None

    def backend_of(self, precision: str) -> str:
        """The engine backend serving ``precision``: the variant's own, else the model's."""
        return self.variant(precision).backend or self.backend

    def model_path(self, precision: str) -> Path:
        return self.directory / self.variant(precision).file

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / self.tokenizer

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to config.json (``directory`` is left out)."""
        return {
            "config_version": CONFIG_VERSION,
            "name": self.name,
            "version": self.version,
            "task": self.task,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "preprocessing_version": self.preprocessing_version,
            "embedding_dim": self.embedding_dim,
            "max_length": self.max_length,
            "tokenizer": self.tokenizer,
            "variants": {p: v.to_dict() for p, v in self.variants.items()},
            "build_key": self.build_key,
            "built_at": self.built_at,
            "source": dict(self.source),
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], directory: Path) -> "ModelConfig":
        """Parse config.json's content; raises ``ModelConfigError`` naming the bad field."""
        where = directory / CONFIG_FILE
        try:
            if data.get("config_version") != CONFIG_VERSION:
                raise ValueError(
                    f"config_version {data.get('config_version')!r} is not {CONFIG_VERSION}"
                )
            variants = {
                str(p): VariantSpec(
                    precision=str(p),
                    file=str(v["file"]),
                    bytes=int(v["bytes"]),
                    fidelity=MappingProxyType(dict(v.get("fidelity", {}))),
                    gate=MappingProxyType({str(m): MappingProxyType({str(k): float(x) for k, x in b.items()})
                                           for m, b in v.get("gate", {}).items()}),
                    backend=str(v.get("backend", "")),
                )
                for p, v in data["variants"].items()
            }
            if not variants:
                raise ValueError("no variants")
            return cls(
                name=str(data["name"]),
                version=str(data["version"]),
                task=str(data["task"]),
                inputs=tuple(_tensor(t) for t in data["inputs"]),
                outputs=tuple(_tensor(t) for t in data["outputs"]),
                preprocessing_version=str(data["preprocessing_version"]),
                embedding_dim=int(data["embedding_dim"]),
                max_length=int(data["max_length"]),
                tokenizer=str(data["tokenizer"]),
                variants=MappingProxyType(variants),
                build_key=str(data["build_key"]),
                built_at=str(data["built_at"]),
                source=MappingProxyType(dict(data.get("source", {}))),
                directory=directory,
                backend=str(data.get("backend") or _legacy_backend(data)),
            )
        except KeyError as e:
            raise ModelConfigError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelConfigError(f"{where}: {e}") from None


def _legacy_backend(data: Mapping[str, Any]) -> str:
    """The backend of a config.json written before it named one (builds are cached by their
    build key, which the new field did not change): the LM's graph has its own engine, and
    Whisper ships as CTranslate2's model.bin; everything else is plain ONNX."""
    if data.get("task") == "text-generation":
        return "lm-onnxruntime"
    if any(str(v.get("file", "")).endswith(".bin") for v in data.get("variants", {}).values()):
        return "ctranslate2"
    return "onnxruntime"


def _tensor(data: Mapping[str, Any]) -> TensorSpec:
    shape = tuple(d if isinstance(d, str) else int(d) for d in data["shape"])
    return TensorSpec(name=str(data["name"]), dtype=str(data["dtype"]), shape=shape)


class ModelRepository:
    """Read-only view of a repository root; builders write with ``workers.models``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def versions(self, name: str) -> list[str]:
        """Complete versions of ``name``, oldest first; empty when there are none."""
        model_dir = self.root / name
        if not model_dir.is_dir():
            return []
        found = [
            d.name
            for d in model_dir.iterdir()
            if d.name.isdigit() and (d / CONFIG_FILE).is_file()
        ]
        return sorted(found, key=int)

    def resolve(self, name: str, version: str | None = None) -> ModelConfig:
        """The config of ``name`` at ``version`` (the newest complete one when None).

        Raises ``ModelNotFoundError`` when nothing is built there (the message says how to
        build it) and ``ModelConfigError`` when config.json is unreadable.
        """
        if version is None:
            versions = self.versions(name)
            if not versions:
                raise ModelNotFoundError(
                    f"model {name!r} is not built in {self.root}: run `mmstream models build`"
                )
            version = versions[-1]
        directory = self.root / name / str(version)
        path = directory / CONFIG_FILE
        if not path.is_file():
            raise ModelNotFoundError(
                f"model {name!r} version {version} is not built in {self.root}: "
                "run `mmstream models build`"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"{path}: cannot read: {e}") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path}: not a JSON object")
        config = ModelConfig.from_dict(data, directory)
        if config.name != name or config.version != str(version):
            raise ModelConfigError(
                f"{path}: describes {config.name} version {config.version}, "
                f"not {name} version {version}"
            )
        return config
