"""`mmstream models build`: export packaged weights into the model repository, once.

A build is keyed by everything that can change its output (``build_key``): the code that
builds it (the recipe's module, the shared export, fidelity and gate modules and the
preprocessing it names, each as its syntax tree, so a comment or a blank line does not
rebuild), the model package's version and the versions of torch, transformers, onnx,
onnxscript and onnxruntime. When the repository already holds a version with that key the
build is skipped without importing torch. Builds write into a scratch directory next to the
target and rename it into place at the end, so a reader never sees half a model; a file
lock keeps two processes on one machine from building the same model at once.

Targets: ``cpu`` (the default) builds what the CPU serves (fp32 and int8); ``gpu`` also adds
an fp16 variant of each ONNX model (``workers.models.fp16``). Every variant's fidelity gate
(``workers.models.gates``) is written into config.json with it.

Run by hand with ``python -m workers.models.build [--root DIR] [--force] [--target gpu] [NAME ...]``.
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from schemas.settings import Settings
from workers import modalities
from workers.models import efficientnet, fp16, minilm, smollm, whisper
from workers.models.gates import with_gates
from workers.repository import (
    CONFIG_FILE,
    ModelConfig,
    ModelRepository,
    ModelRepositoryError,
)
from workers.text import PREPROCESSING_VERSION

# Bump to invalidate every cached build for a reason neither the code nor the versions
# below show (a data file read by a recipe changed, say).
EXPORTER_VERSION = "2"

# Modules whose code decides every recipe's output, beside each recipe's own ``sources``.
SHARED_SOURCES = ("workers.models.build", "workers.models.recipe", "workers.models.export",
                  "workers.models.fidelity", "workers.models.gates", "workers.repository")

# Libraries whose versions change what a build produces.
_TOOLCHAIN = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")

Log = Callable[[str], None]


@dataclass(frozen=True)
class Recipe:
    """How to build one model: ``build(scratch_dir, build_key, log)`` writes the files and
    returns the config (without writing config.json). ``sources`` names the modules, beyond
    ``build``'s own and ``SHARED_SOURCES``, whose code decides what it writes (the
    preprocessing it measures fidelity through, the engine it checks a variant with)."""

    name: str
    version: str
    package: str  # distribution that ships the weights
    build: Callable[[Path, str, Log], ModelConfig]
    sources: tuple[str, ...] = ()
    toolchain: tuple[str, ...] = ()  # distributions beyond ``_TOOLCHAIN`` whose versions change its output


RECIPES: Mapping[str, Recipe] = {
    minilm.NAME: Recipe(minilm.NAME, minilm.VERSION, minilm.PACKAGE, minilm.build, ("workers.text",)),
    efficientnet.NAME: Recipe(efficientnet.NAME, efficientnet.VERSION, efficientnet.PACKAGE, efficientnet.build,
                              ("workers.image",)),
    smollm.NAME: Recipe(smollm.NAME, smollm.VERSION, smollm.PACKAGE, smollm.build,
                        ("workers.models.smollm_graph", "workers.prompt", "workers.engines.lm", "workers.engines.lm_types",
                         "workers.engines.llama"),
                        ("llama-cpp-python",)),
    whisper.NAME: Recipe(whisper.NAME, whisper.VERSION, whisper.PACKAGE, whisper.build,
                         ("workers.audio", "workers.audio.decode", "workers.audio.encoder", "workers.audio.vad",
                          "workers.audio.windows", "workers.engines.ctranslate2")),
}
"""Every model this package knows how to build. A modality names its own in its spec."""


def default_models() -> list[str]:
    """What a build without names builds: each registered modality's recipe (plugins loaded
    by the caller), then the language model's."""
    return list(dict.fromkeys([*(s.recipe for s in modalities.specs() if s.recipe), smollm.NAME]))


class BuildError(ModelRepositoryError):
    """A build was asked for something that cannot be built."""


@dataclass(frozen=True)
class BuildReport:
    """Outcome of one model's build."""

    name: str
    version: str
    status: str  # "built" or "up to date"
    seconds: float  # wall time of this model's step, the cache check included
    directory: Path
    build_key: str
    fidelity: Mapping[str, Mapping[str, object]]  # precision -> fidelity as stored in config.json

    def summary(self) -> str:
        return f"{self.name}/{self.version}: {self.status} in {self.seconds:.1f} s ({self.directory})"


def build_key(recipe: Recipe) -> str:
    """Hex digest naming this recipe's output; raises ``BuildError`` when a library is missing."""
    parts = {
        "exporter": EXPORTER_VERSION,
        "model": [recipe.name, recipe.version],
        "preprocessing": PREPROCESSING_VERSION,
        "package": [recipe.package, _version(recipe.package)],
        "toolchain": {lib: _version(lib) for lib in (*_TOOLCHAIN, *recipe.toolchain)},
        "code": code_digest((recipe.build.__module__, *recipe.sources, *SHARED_SOURCES)),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def code_digest(modules: tuple[str, ...]) -> str:
    """Digest of the named modules' code, read from their files without importing them:
    each file's syntax tree (``ast.dump``), so comments and layout do not count but any
    change to what the code does, its docstrings and constants included, does. A module
    that is not a plain source file (built in, or gone) counts by its name alone."""
    digest = hashlib.sha256()
    for module in sorted(set(modules)):
        spec = importlib.util.find_spec(module)
        digest.update(module.encode() + b"\0")
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
            digest.update(ast.dump(tree).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(
            f"{distribution} is not installed; model builds need the `build` extra "
            f"(pip install 'mmstream[build]') and the model packages"
        ) from None


TARGETS = ("cpu", "gpu")


def build_models(
    repo_root: Path, names: list[str] | None = None, force: bool = False, log: Log = print, target: str = "cpu"
) -> list[BuildReport]:
    """Build ``names`` (every known model when None) into ``repo_root`` for ``target``.

    Skips a model whose repository version already has the current build key (and, for
    ``gpu``, an fp16 variant of the current recipe), unless ``force``. Returns one report
    per model, in order. Raises ``BuildError`` for an unknown name or target or a missing
    build dependency, and the recipe's own errors (the repository is then left as it was).
    """
    names = default_models() if names is None else names
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise BuildError(f"unknown models {unknown}; known: {sorted(RECIPES)}")
    if target not in TARGETS:
        raise BuildError(f"unknown build target {target!r}; targets: {', '.join(TARGETS)}")
    return [_build_one(Path(repo_root), RECIPES[n], force, log, target) for n in names]


def ensure_built(repo_root: Path, name: str, log: Log = print) -> ModelConfig:
    """The config of ``name`` in ``repo_root``, building it first if it is missing or stale."""
    report = build_models(repo_root, [name], log=log)[0]
    return ModelRepository(repo_root).resolve(name, report.version)


def _build_one(root: Path, recipe: Recipe, force: bool, log: Log, target: str = "cpu") -> BuildReport:
    start = time.monotonic()
    key = build_key(recipe)
    model_dir = root / recipe.name
    model_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(model_dir / ".lock"):
        # Checked under the lock: another process may have just finished the same build.
        current = None if force else _current(root, recipe, key)
        if current is not None:
            status = "up to date"
        else:
            _remove_scratch(model_dir)
            current = _build_into_place(model_dir, recipe, key, log)
            status = "built"
        if target == "gpu":
            before = current.variants.get("fp16")
            current = fp16.ensure_fp16(current, log, force)
            if current.variants.get("fp16") != before:
                status = f"{status}, fp16 built"
    report = BuildReport(
        name=recipe.name,
        version=recipe.version,
        status=status,
        seconds=time.monotonic() - start,
        directory=current.directory,
        build_key=key,
        fidelity={p: dict(v.fidelity) for p, v in current.variants.items()},
    )
    log(report.summary())
    return report


def _current(root: Path, recipe: Recipe, key: str) -> ModelConfig | None:
    """The built config when it has ``key`` and all its files, else None."""
    try:
        config = ModelRepository(root).resolve(recipe.name, recipe.version)
    except ModelRepositoryError:
        return None
    files = [config.tokenizer_path, *(config.model_path(p) for p in config.variants)]
    if config.build_key != key or not all(f.is_file() for f in files):
        return None
    return config


def _build_into_place(model_dir: Path, recipe: Recipe, key: str, log: Log) -> ModelConfig:
    scratch = Path(tempfile.mkdtemp(prefix=f".build-{recipe.version}-", dir=model_dir))
    try:
        scratch.chmod(0o755)  # mkdtemp makes it private; workers may run as another user
        config = with_gates(recipe.build(scratch, key, log))
        # config.json last: its presence is what makes a version directory complete.
        (scratch / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        final = model_dir / recipe.version
        if final.exists():
            # Directories cannot be swapped in one rename; move the old one aside first.
            # In between, readers find no version (a clear error), never a mixed one.
            old = model_dir / f".old-{recipe.version}-{os.getpid()}"
            os.rename(final, old)
            os.rename(scratch, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(scratch, final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return ModelRepository(model_dir.parent).resolve(recipe.name, recipe.version)


def _remove_scratch(model_dir: Path) -> None:
    """Delete what killed builds left behind; safe because we hold the model's lock."""
    for entry in model_dir.iterdir():
        if entry.is_dir() and entry.name.startswith((".build-", ".old-")):
            shutil.rmtree(entry, ignore_errors=True)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    settings = Settings.from_env()
    modalities.load_plugins(settings.modalities.plugins)
    parser = argparse.ArgumentParser(prog="python -m workers.models.build", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"models to build (default: {', '.join(default_models())}; "
                                                 f"known: {', '.join(RECIPES)})")
    parser.add_argument("--root", type=Path, help="repository root (default: MMSTREAM_MODELS_REPOSITORY)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--target", choices=TARGETS, default="cpu", help="gpu also builds fp16 variants")
    args = parser.parse_args(argv)
    if args.root is None:
        args.root = settings.models.repository
    for report in build_models(args.root, args.names or None, force=args.force, target=args.target):
        for precision, fidelity in report.fidelity.items():
            print(f"  {precision}: {fidelity}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
