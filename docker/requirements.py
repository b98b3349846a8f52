"""Print the pip requirements of one image layer, read from pyproject.toml.

    python docker/requirements.py runtime cpu   # the core dependencies (onnxruntime for CPUs)
    python docker/requirements.py runtime gpu   # the same with onnxruntime replaced by infra/gpu/requirements-gpu.txt
    python docker/requirements.py build         # the build extra (torch & co., models stage only)

The Dockerfile installs these before it copies any code, so a code edit reuses the layer
with every dependency in it. The GPU set never holds onnxruntime and onnxruntime-gpu side
by side: with both installed the CUDA provider disappears.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(pyproject: Path, layer: str, runtime: str = "cpu") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    if layer == "build":
        return list(extras["build"])
    if layer != "runtime" or runtime not in ("cpu", "gpu"):
        raise SystemExit(f"usage: {sys.argv[0]} runtime cpu|gpu | build")
    core = list(project["dependencies"])
    if runtime == "cpu":
        return core
    # The GPU set has one source, the file `make gpu-setup` installs from (onnxruntime-gpu and
    # the CUDA/cuDNN wheels it was checked against).
    pins = pyproject.parent / "infra" / "gpu" / "requirements-gpu.txt"
    gpu = [line.strip() for line in pins.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [r for r in core if _name(r) != "onnxruntime"] + gpu


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    print("\n".join(requirements(root / "pyproject.toml", *sys.argv[1:3])))
