"""Reports of `mmstream bench` runs: the JSON schema of a run, a validator for it, and
``write_report``: ``report.md`` plus PNG plots (matplotlib, Agg: no display needed).

Plots:

- ``latency_cdf.png``: e2e latency CDF, one panel per request kind, one line per run;
- ``stages.png``: per stage, queue vs service time stacked, at p50 and p95 (the lowest
  rate of each input, so a sweep does not crowd it);
- ``p99_vs_throughput.png``: e2e p99 against achieved throughput, one line per input and
  request kind (when an input sweeps rates or two inputs are compared).

Given two inputs (pipeline and monolithic), the curves share axes and the report adds a
side-by-side table at every rate both have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

# -- schema ------------------------------------------------------------------------------

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["count"],
    "properties": {"count": {"type": "integer"}, "mean": _NUM, "p50": _NUM, "p95": _NUM, "p99": _NUM, "max": _NUM},
    "additionalProperties": False,
}
_STAGE = {"type": "object", "required": ["queued", "service"],
          "properties": {"queued": SUMMARY_SCHEMA, "service": SUMMARY_SCHEMA}, "additionalProperties": False}
_P50_P95 = {"type": "object", "required": ["p50", "p95"], "properties": {"p50": _NUM, "p95": _NUM}}

RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["mode", "workload", "config", "offered_rate", "achieved_rate", "requests", "latency_ms",
                 "throughput", "cpu", "peak_rss_mb", "floor_ms", "overhead_ms", "samples_ms"],
    "properties": {
        "mode": {"enum": ["pipeline", "monolithic"]},
        "workload": {"enum": ["text", "mixed", "chat"]},
        "config": {"type": "object", "required": ["rate", "seed", "duration_s"]},
        "offered_rate": _NUM,
        "achieved_rate": _NUM,
        "requests": {
            "type": "object", "required": ["sent", "ok", "errors", "lost"],
            "properties": {"sent": {"type": "integer"}, "ok": {"type": "integer"}, "lost": {"type": "integer"},
                           "errors": {"type": "object", "additionalProperties": {"type": "integer"}}},
        },
        "latency_ms": {
            "type": "object",
            "additionalProperties": {
                "type": "object", "required": ["e2e", "stages"],
                "properties": {"e2e": SUMMARY_SCHEMA,
                               "stages": {"type": "object", "additionalProperties": _STAGE}},
            },
        },
        "throughput": {
            "type": "object", "required": ["requests_per_s", "parts_per_s"],
            "properties": {"requests_per_s": {"type": "object", "additionalProperties": _NUM},
                           "parts_per_s": {"type": "object", "additionalProperties": _NUM}},
        },
        "cpu": {
            "type": "object", "required": ["scope", "total_s", "per_request_ms", "per_process_s"],
            "properties": {"scope": {"type": "string"}, "total_s": _NUM, "per_request_ms": _NUM_OR_NULL,
                           "per_process_s": {"type": "object", "additionalProperties": _NUM}},
        },
        "peak_rss_mb": {"type": "object", "additionalProperties": _NUM_OR_NULL},
        "floor_ms": {"type": "object", "required": ["encode.text"], "additionalProperties": _NUM},
        "overhead_ms": {
            "type": "object",
            "additionalProperties": {
                "type": "object", "required": ["floor_ms", "total", "hops"],
                "properties": {"floor_ms": _NUM, "total": _P50_P95,
                               "hops": {"type": "object", "additionalProperties": _P50_P95}},
            },
        },
        "samples_ms": {
            "type": "object", "required": ["e2e"],
            "properties": {"e2e": {"type": "object", "additionalProperties": {"type": "array", "items": _NUM}}},
        },
        "batch_size": SUMMARY_SCHEMA,
        "by_lane": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["e2e", "requests"], "properties": {"e2e": SUMMARY_SCHEMA}}},
        "by_cache": {"type": "object", "additionalProperties": SUMMARY_SCHEMA},
        "generation": {"type": "object", "required": ["ttft_ms", "tpot_ms"],
                       "properties": {"ttft_ms": SUMMARY_SCHEMA, "tpot_ms": SUMMARY_SCHEMA}},
        "cache": {"type": "object", "required": ["hits", "misses"],
                  "properties": {"hits": {"type": "integer"}, "misses": {"type": "integer"}}},
    },
}
SWEEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["mode", "workload", "runs"],
    "properties": {"mode": RUN_SCHEMA["properties"]["mode"], "workload": RUN_SCHEMA["properties"]["workload"],
                   "runs": {"type": "array", "items": RUN_SCHEMA}},
}

_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "number": (int, float), "integer": int,
}


class BenchSchemaError(ValueError):
    """A bench JSON does not match ``RUN_SCHEMA`` / ``SWEEP_SCHEMA``; ``problems`` lists each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("bench JSON does not match its schema: " + "; ".join(problems[:10]))
        self.problems = problems


def schema_problems(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Every place ``value`` breaks ``schema`` (a JSON-Schema subset: type, enum, required,
    properties, additionalProperties, items), as ``path: what``; [] when it matches."""
    problems: list[str] = []
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        # bool is an int in Python but not a number in JSON.
        if not any(isinstance(value, _TYPES[k]) and not (isinstance(value, bool) and k in ("number", "integer"))
                   for k in kinds):
            return [f"{path}: expected {'|'.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        problems += [f"{path}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                problems += schema_problems(v, props[k], f"{path}.{k}")
            elif extra is False:
                problems.append(f"{path}: unexpected {k!r}")
            elif isinstance(extra, dict):
                problems += schema_problems(v, extra, f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            problems += schema_problems(v, schema["items"], f"{path}[{i}]")
    return problems


def validate(doc: Any) -> list[dict[str, Any]]:
    """Check a bench JSON (one run, or a sweep with ``runs``); returns its runs.

    Raises ``BenchSchemaError`` listing every problem.
    """
    schema = SWEEP_SCHEMA if isinstance(doc, dict) and "runs" in doc else RUN_SCHEMA
    problems = schema_problems(doc, schema)
    if problems:
        raise BenchSchemaError(problems)
    return list(doc["runs"]) if schema is SWEEP_SCHEMA else [doc]


def load(path: Path) -> list[dict[str, Any]]:
    """The validated runs of a bench JSON file. Raises ``BenchSchemaError``, ``OSError``
    and ``json.JSONDecodeError``."""
    return validate(json.loads(Path(path).read_text()))


# -- report --------------------------------------------------------------------------------

PLOTS = ("latency_cdf.png", "stages.png", "p99_vs_throughput.png")


def fmt(x: Any) -> str:
    """How the report prints a millisecond or rate value (tests parse it back)."""
    return "–" if x is None else f"{x:.2f}"


def write_report(inputs: Sequence[Any], out_dir: Path, labels: Sequence[str] | None = None) -> Path:
    """Write ``report.md`` and the PNG plots for ``inputs`` (bench JSON dicts, each one run
    or a sweep) into ``out_dir``; returns the report's path.

    ``labels`` name the inputs in legends (default: each input's mode). Raises
    ``BenchSchemaError`` when an input does not validate.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    series = [sorted(validate(doc), key=lambda r: r["config"]["rate"]) for doc in inputs]
    names = list(labels) if labels else _labels(series)
    lines = ["# mmstream bench report", ""]
    lines += _md_runs(series, names)
    if len(series) == 2:
        lines += _md_compare(series, names)
    plots = _plots(series, names, out_dir)
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _labels(series: list[list[dict[str, Any]]]) -> list[str]:
    names = [runs[0]["mode"] if runs else "?" for runs in series]
    return [n if names.count(n) == 1 else f"{n} #{i + 1}" for i, n in enumerate(names)]


def _md_runs(series: list[list[dict[str, Any]]], names: list[str]) -> list[str]:
    lines: list[str] = []
    for name, runs in zip(names, series):
        for run in runs:
            req = run["requests"]
            lines += [f"## {name}: {run['workload']} at {fmt(run['config']['rate'])} req/s", "",
                      f"offered {fmt(run['offered_rate'])} req/s, achieved {fmt(run['achieved_rate'])} req/s; "
                      f"sent {req['sent']}, ok {req['ok']}, errors {sum(req['errors'].values())}, lost {req['lost']}. "
                      f"Engine floor at batch 1: "
                      + ", ".join(f"{k} {fmt(v)} ms" for k, v in run["floor_ms"].items()) + ".", "",
                      "| kind | n | p50 | p95 | p99 | floor | overhead p50 | overhead p95 |",
                      "|---|---|---|---|---|---|---|---|"]
            for kind, lat in run["latency_ms"].items():
                e, o = lat["e2e"], run["overhead_ms"].get(kind)
                lines.append(f"| {kind} | {e['count']} | {fmt(e.get('p50'))} | {fmt(e.get('p95'))} | "
                             f"{fmt(e.get('p99'))} | {fmt(o and o['floor_ms'])} | "
                             f"{fmt(o and o['total']['p50'])} | {fmt(o and o['total']['p95'])} |")
            lines += ["", "| kind | stage | queued p50 | queued p95 | service p50 | service p95 | hop overhead p50 |",
                      "|---|---|---|---|---|---|---|"]
            for kind, lat in run["latency_ms"].items():
                hops = (run["overhead_ms"].get(kind) or {}).get("hops", {})
                for stage, st in lat["stages"].items():
                    q, s = st["queued"], st["service"]
                    lines.append(f"| {kind} | {stage} | {fmt(q.get('p50'))} | {fmt(q.get('p95'))} | "
                                 f"{fmt(s.get('p50'))} | {fmt(s.get('p95'))} | "
                                 f"{fmt(hops.get(stage, {}).get('p50'))} |")
            cpu = run["cpu"]
            rss = ", ".join(f"{k} {v:.0f}" for k, v in run["peak_rss_mb"].items() if v is not None)
            tput = ", ".join(f"{k} {fmt(v)}/s" for k, v in run["throughput"]["parts_per_s"].items())
            cache = run.get("cache")
            hits = f" Reuse cache: {cache['hits']} hits, {cache['misses']} misses." if cache else ""
            lines += ["", f"CPU per request: {fmt(cpu['per_request_ms'])} ms ({cpu['scope']}). "
                      f"Peak RSS (MiB): {rss}. Parts encoded: {tput}.{hits}", ""]
    lines += ["Overhead is latency beyond compute: e2e minus the batch-1 floors of the request's parts "
              "run one after another; per hop, queued + service minus that engine's floor.", ""]
    return lines


def _md_compare(series: list[list[dict[str, Any]]], names: list[str]) -> list[str]:
    a, b = ({run["config"]["rate"]: run for run in runs} for runs in series)
    lines = [f"## {names[0]} vs {names[1]}", "",
             f"| rate | kind | {names[0]} p50 / p95 / p99 | {names[1]} p50 / p95 / p99 | p99 ratio |",
             "|---|---|---|---|---|"]
    for rate in sorted(set(a) & set(b)):
        for kind in sorted(set(a[rate]["latency_ms"]) & set(b[rate]["latency_ms"])):
            ea, eb = a[rate]["latency_ms"][kind]["e2e"], b[rate]["latency_ms"][kind]["e2e"]
            if not ea.get("count") or not eb.get("count"):
                continue
            ratio = ea["p99"] / eb["p99"] if eb["p99"] else None
            lines.append(f"| {fmt(rate)} | {kind} | {fmt(ea['p50'])} / {fmt(ea['p95'])} / {fmt(ea['p99'])} | "
                         f"{fmt(eb['p50'])} / {fmt(eb['p95'])} / {fmt(eb['p99'])} | {fmt(ratio)} |")
    return lines + [""]


def _plots(series: list[list[dict[str, Any]]], names: list[str], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    kinds = sorted({k for runs in series for run in runs for k in run["samples_ms"]["e2e"]})
    if kinds:
        fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            for name, runs in zip(names, series):
                for run in runs:
                    xs = sorted(run["samples_ms"]["e2e"].get(kind, []))
                    if xs:
                        ys = [(i + 1) / len(xs) for i in range(len(xs))]
                        ax.step(xs, ys, where="post", label=f"{name} @ {run['config']['rate']:g}/s")
            ax.set(title=f"e2e latency CDF: {kind}", xlabel="ms", ylabel="fraction of requests", xscale="log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / "latency_cdf.png", dpi=100)
        plt.close(fig)
        written.append("latency_cdf.png")

    bars = []  # (label, queued, service) at p50 then p95
    for name, runs in zip(names, series):
        if not runs:
            continue
        run = runs[0]
        for kind, lat in run["latency_ms"].items():
            for stage, st in lat["stages"].items():
                for q in ("p50", "p95"):
                    if st["service"].get("count"):
                        bars.append((f"{name}\n{kind}\n{stage} {q}", st["queued"][q], st["service"][q]))
    if bars:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(bars)), 5))
        xs = range(len(bars))
        ax.bar(xs, [b[1] for b in bars], label="queued", color="tab:orange")
        ax.bar(xs, [b[2] for b in bars], bottom=[b[1] for b in bars], label="service", color="tab:blue")
        ax.set_xticks(list(xs), [b[0] for b in bars], rotation=90, fontsize="x-small")
        ax.set(ylabel="ms", title="per stage: queued vs service (p50, p95; lowest rate)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "stages.png", dpi=100)
        plt.close(fig)
        written.append("stages.png")

    if len(series) > 1 or any(len(runs) > 1 for runs in series):
        fig, ax = plt.subplots(figsize=(7, 5))
        for name, runs in zip(names, series):
            for kind in kinds:
                pts = [(r["achieved_rate"], r["latency_ms"][kind]["e2e"]["p99"]) for r in runs
                       if r["latency_ms"].get(kind, {}).get("e2e", {}).get("count")]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name}: {kind}")
        ax.set(xlabel="achieved requests/s", ylabel="e2e p99 (ms)", yscale="log", title="p99 vs throughput")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / "p99_vs_throughput.png", dpi=100)
        plt.close(fig)
        written.append("p99_vs_throughput.png")
    return written
