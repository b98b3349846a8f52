#!/usr/bin/env bash
# `make cpu-setup`: undo infra/gpu/setup.sh: onnxruntime-gpu out, the pinned CPU onnxruntime back.
# The CUDA wheels stay (torch, in the build extra, uses the same ones).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
ORT_CPU=$(sed -n 's/^ *"onnxruntime==\([^"]*\)".*/\1/p' pyproject.toml)
"$PY" -m pip uninstall -q -y onnxruntime-gpu onnxruntime tensorrt-cu13-libs tensorrt-cu13-bindings >/dev/null 2>&1 || true
"$PY" -m pip install -q --disable-pip-version-check "onnxruntime==$ORT_CPU"
echo "cpu-setup: onnxruntime $ORT_CPU"
