#!/usr/bin/env bash
# `make gpu-setup`: turn a set-up virtualenv (`make setup`) into a GPU one, in place.
#
# Swaps the CPU onnxruntime for onnxruntime-gpu (never both: they ship the same `onnxruntime`
# module), installs the CUDA 13 / cuDNN 9 wheels it needs and cuBLAS 12 for CTranslate2
# (requirements-gpu.txt says how those were chosen), then TensorRT if the configured package
# index has its libraries (requirements-tensorrt.txt says why PyPI alone does not). Re-run it
# after anything that reinstalls the project (`pip install -e .` brings the CPU onnxruntime
# back); `make cpu-setup` undoes it.
#
# Usage: infra/gpu/setup.sh [PYTHON]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if [[ ! -x "$PY" ]]; then
    echo "gpu-setup: $PY does not exist; run \`make setup\` first" >&2
    exit 2
fi
ORT_CPU=$(sed -n 's/^ *"onnxruntime==\([^"]*\)".*/\1/p' pyproject.toml)
"$PY" -m pip uninstall -q -y onnxruntime onnxruntime-gpu >/dev/null 2>&1 || true
"${PIP[@]}" --only-binary=:all: -r infra/gpu/requirements-gpu.txt
if "${PIP[@]}" --only-binary=:all: -r infra/gpu/requirements-tensorrt.txt 2>/tmp/mmstream-trt-install.log; then
    echo "gpu-setup: TensorRT libraries installed"
else
    echo "gpu-setup: TensorRT libraries are not on this package index (see infra/gpu/requirements-tensorrt.txt);"
    echo "           the TensorRT provider will be skipped and CUDA serves. To skip the attempt at each start:"
    echo "           export MMSTREAM_ENCODER_PROVIDERS=cuda,cpu"
fi
"$PY" - <<PYEOF
import importlib.metadata as md, onnxruntime as ort
have = ort.get_available_providers()
assert "CUDAExecutionProvider" in have, f"onnxruntime {ort.__version__} has no CUDA provider: {have}"
try:
    md.version("onnxruntime")
    raise SystemExit("the CPU onnxruntime came back beside onnxruntime-gpu: re-run make gpu-setup")
except md.PackageNotFoundError:
    pass
print(f"gpu-setup: onnxruntime-gpu {ort.__version__}, providers {have} (CPU build was ${ORT_CPU})")
PYEOF
