#!/usr/bin/env bash
# Installs llama-cpp-python (the CPU generation engine) into the given Python, built from its
# source distribution: the registry has no wheel for this platform. The build takes 4-5 min
# on 2 cores, so the wheel is kept in ~/.cache/mmstream/wheels under a key made of the
# version, the build flags and this CPU's instruction-set flags: ggml is built for the CPU it
# is built on (GGML_NATIVE), and a wheel built where AVX-512 exists dies with an illegal
# instruction where it does not, so a machine only ever reuses a wheel built for its own flags.
# Usage: infra/llama-cpp.sh PYTHON
set -euo pipefail
PY=${1:?usage: infra/llama-cpp.sh PYTHON}
VERSION=0.3.36
# Without AMX, even where the CPU has it: on a KVM Xeon with AMX (2026-12-06) ggml's AMX weight
# buffers made the first llama_decode segfault (llama-cpp-python's own Llama() as well), and
# GCC lets an explicit -mno-* win over -march=native whatever their order.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX' -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
CPU_FLAGS=$(grep -o -w -E 'sse4_2|avx|avx2|fma|f16c|bmi2|avx512[a-z_0-9]*|amx[a-z_0-9]*|asimd|sve' /proc/cpuinfo 2>/dev/null | sort -u || true)
KEY=$( (echo "$VERSION $CMAKE_FLAGS $(uname -m)"; echo "$CPU_FLAGS") | sha1sum | cut -c1-16)
CACHE=${MMSTREAM_WHEEL_CACHE:-$HOME/.cache/mmstream/wheels}/llama-cpp-python-$VERSION-$KEY
if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null \
   && [ -f "$CACHE/.installed-from" ] && [ "$(cat "$CACHE/.installed-from")" = "$("$PY" -c 'import sys; print(sys.prefix)')" ]; then
  exit 0
fi
if ! ls "$CACHE"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "mmstream: building llama-cpp-python $VERSION from source for this CPU (once per machine; 4-5 min on 2 cores)" >&2
  tmp=$(mktemp -d)
  # --no-cache-dir: pip keeps wheels it built from an sdist and reuses them whatever CMAKE_ARGS
  # says, so a change of the flags above would install the old build under the new key.
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PY" -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-deps --no-binary llama-cpp-python \
      -w "$tmp" "llama-cpp-python==$VERSION"
  mkdir -p "$CACHE" && mv "$tmp"/llama_cpp_python-*.whl "$CACHE"/ && rm -rf "$tmp"
fi
# The wheel itself, then its declared dependencies (diskcache, jinja2, ...) without touching
# what is installed already (numpy stays at the project's pin).
"$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$CACHE"/llama_cpp_python-*.whl
"$PY" -m pip install -q --disable-pip-version-check "$CACHE"/llama_cpp_python-*.whl
"$PY" -c 'import sys; print(sys.prefix)' > "$CACHE/.installed-from"
