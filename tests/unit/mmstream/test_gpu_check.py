"""The CPU-testable parts of the GPU check: the scripts parse, check.sh stops at once without a
GPU, the pins never put the CPU and GPU runtimes side by side, and the report is built from
whatever the steps left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from mmstream import enginebench, gpureport
from schemas.settings import Settings

REPO = Path(__file__).resolve().parents[3]
GPU = REPO / "infra" / "gpu"


@pytest.mark.parametrize("script", ["check.sh", "setup.sh", "cpu-setup.sh"])
def test_the_scripts_parse(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True).returncode == 0


def test_check_stops_early_and_clearly_without_a_gpu(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(out)}
    result = subprocess.run(["bash", str(GPU / "check.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 3
    assert "no NVIDIA GPU here" in result.stderr
    assert not (out / "gpu-check.json").exists()


def _pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def test_gpu_pins_never_install_both_runtimes_and_agree_with_the_extra() -> None:
    gpu = _pins(GPU / "requirements-gpu.txt")
    assert gpu["onnxruntime-gpu"] and "onnxruntime" not in gpu
    assert all(re.fullmatch(r"[0-9][0-9.]*", v) for v in gpu.values()), gpu
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = dict(dep.split("==") for dep in project["optional-dependencies"]["gpu"])
    assert "onnxruntime-gpu" not in extra and "tensorrt" not in extra  # the swap is setup.sh's
    assert extra == {k: v for k, v in gpu.items() if k != "onnxruntime-gpu"}
    trt = _pins(GPU / "requirements-tensorrt.txt")
    assert set(trt) == {"tensorrt-cu13-libs", "tensorrt-cu13-bindings"} and len(set(trt.values())) == 1
    assert trt["tensorrt-cu13-libs"].startswith("10.")  # onnxruntime-gpu 1.31.1 links libnvinfer.so.10


def test_the_report_is_built_from_what_the_steps_left(tmp_path: Path) -> None:
    (tmp_path / "steps.jsonl").write_text(
        '{"step": "setup-gpu", "status": "ok", "rc": 0, "seconds": 80}\n'
        '{"step": "pipeline", "status": "skipped", "reason": "no JDK", "seconds": 0}\nnot json\n')
    (tmp_path / "gpu.txt").write_text("NVIDIA H200, 570.1, 143771 MiB\n")
    (tmp_path / "engines.json").write_text(json.dumps({"rows": [
        {"model": "m", "providers": "CUDAExecutionProvider", "requested": "fp16", "served": "fp32",
         "provider": "CUDAExecutionProvider", "batch1_ms": 1.5, "fallbacks": [{"from": "fp16", "to": "fp32", "reason": "fidelity"}]}]}))
    (tmp_path / "gpu-tests.xml").write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>')
    (tmp_path / "bench-pipeline.json").write_text("{broken")
    assert gpureport.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["step"] for s in doc["steps"]] == ["setup-gpu", "pipeline"]
    assert doc["tests"] == {"tests": 7, "failures": 1, "errors": 0, "skipped": 2}
    assert any("steps.jsonl" in p for p in doc["problems"]) and any("bench-pipeline.json" in p for p in doc["problems"])
    md = (tmp_path / "gpu-report.md").read_text()
    assert "GPU: NVIDIA H200" in md and "| pipeline | skipped | 0 | no JDK |" in md
    assert "fp16->fp32 (fidelity)" in md and "7 run, 1 failed" in md


def test_the_engine_bench_runs_on_the_cpu_and_shows_the_fallbacks(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from tests.unit.workers.test_engine_gate import with_variants

    (tmp_path / "tiny" / "1").mkdir(parents=True)
    with_variants(tmp_path / "tiny" / "1", fp16={})
    settings = Settings.from_env({"MMSTREAM_MODELS_REPOSITORY": str(tmp_path)})
    doc = enginebench.run(settings, [("CPUExecutionProvider",)], ["fp32", "fp16"], batch=2, repeats=2, models=["tiny"])
    fp32, fp16 = doc["rows"]
    assert (fp32["served"], fp32["min_cosine_to_fp32"], fp32["batch1_ms"] > 0) == ("fp32", 1.0, True)
    assert fp16["served"] == "fp32" and fp16["fallbacks"] == [{"from": "fp16", "to": "fp32", "reason": "provider"}]
    assert "| tiny | CPUExecutionProvider | fp16 | fp32 |" in enginebench.report(doc)


def test_status_shows_the_engine_a_worker_publishes() -> None:
    from prometheus_client import generate_latest

    from mmstream import engineinfo
    from streams.observe.metrics import Metrics

    m = Metrics()
    assert engineinfo.summary(generate_latest(m.registry).decode()) is None  # router, assembler: no engine
    m.set_engine("encode.text", {"model": "all-minilm-l6-v2", "version": "1", "precision": "fp16",
                                 "provider": "CUDAExecutionProvider", "backend": "onnxruntime"})
    assert engineinfo.summary(generate_latest(m.registry).decode()) == \
        "all-minilm-l6-v2/1 fp16 on CUDAExecutionProvider (onnxruntime)"
    assert engineinfo.scrape(1, timeout_s=0.2) is None  # nothing listens: no answer, no crash
