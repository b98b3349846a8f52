"""The last step of infra/gpu/check.sh: one JSON and one Markdown report from what its steps left.

``python -m mmstream.gpureport OUT_DIR`` reads OUT_DIR/steps.jsonl (one line per step:
status, seconds), gpu.txt (nvidia-smi's name, driver, memory), engines.json
(``mmstream.enginebench``), gpu-tests.xml (pytest's junit) and bench-*.json (``mmstream
bench``), each optional, and writes OUT_DIR/gpu-check.json and OUT_DIR/gpu-report.md.
``combine`` and ``render`` are pure over what was read; a missing or broken file is named
in the report, never a crash (the check must still say what it got).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from mmstream.enginebench import report as engine_table


def read(out: Path) -> dict[str, Any]:
    """Everything the steps left in ``out``, parsed; unreadable files land in ``problems``."""
    doc: dict[str, Any] = {"kind": "gpu-check", "v": 1, "steps": [], "problems": []}
    steps = out / "steps.jsonl"
    for line in steps.read_text().splitlines() if steps.is_file() else []:
        try:
            doc["steps"].append(json.loads(line))
        except ValueError:
            doc["problems"].append(f"steps.jsonl: unreadable line {line[:80]!r}")
    gpu = out / "gpu.txt"
    doc["gpu"] = gpu.read_text().strip() if gpu.is_file() else None
    for name, key in (("engines.json", "engines"), ("bench-pipeline.json", "bench_pipeline"),
                      ("bench-monolithic.json", "bench_monolithic")):
        path = out / name
        if path.is_file():
            try:
                doc[key] = json.loads(path.read_text())
            except ValueError as exc:
                doc["problems"].append(f"{name}: {exc}")
    tests = out / "gpu-tests.xml"
    if tests.is_file():
        try:
            doc["tests"] = junit_summary(tests.read_text())
        except ET.ParseError as exc:
            doc["problems"].append(f"gpu-tests.xml: {exc}")
    return doc


def junit_summary(xml: str) -> dict[str, int]:
    """Test counts from pytest's junit XML: tests, failures, errors, skipped."""
    root = ET.fromstring(xml)
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def render(doc: dict[str, Any]) -> str:
    """The Markdown report of ``read``'s document."""
    lines = ["# GPU check", "", f"GPU: {doc.get('gpu') or 'unknown'}", "", "## Steps", "",
             "| step | status | seconds | note |", "|---|---|---|---|"]
    for s in doc["steps"]:
        lines.append(f"| {s.get('step')} | {s.get('status')} | {s.get('seconds', '')} | {s.get('reason', '')} |")
    if "tests" in doc:
        t = doc["tests"]
        lines += ["", f"GPU tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"]
    if "engines" in doc:
        lines += ["", "## Engines (per provider list and precision)", "", engine_table(doc["engines"]).rstrip()]
    for mode in ("pipeline", "monolithic"):
        run = doc.get(f"bench_{mode}")
        if run:
            runs = run.get("runs", [run])
            lat = runs[0].get("latency_ms", {}).get("text", {}).get("e2e", {}) if runs else {}
            lines += ["", f"Bench {mode}: e2e p50 {lat.get('p50')} ms, p95 {lat.get('p95')} ms, "
                          f"achieved {runs[0].get('achieved_rate') if runs else None} req/s"]
    if doc["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in doc["problems"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mmstream.gpureport OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    doc = read(out)
    (out / "gpu-check.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "gpu-report.md").write_text(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
