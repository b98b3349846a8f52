"""Reports of `mmstream bench` runs: the JSON schema of a run, a validator for it, and
``write_report``: ``report.md`` plus PNG plots (matplotlib, Agg: no display needed).

Plots (read at a glance: one line per mode, a log axis wherever values span more than
``LOG_RATIO`` to one, units on every axis):

- ``latency_cdf.png``: e2e latency CDF, one panel per request kind, one line per run;
- ``stages.png``: per stage, queued and service time side by side, p50 and p95 in two
  panels (the lowest rate of each input, so a sweep does not crowd it);
- ``p99_vs_throughput.png``: e2e p99 against achieved throughput, one line per mode and
  request kind: runs of the same mode join one line in rate order, whichever input file
  they came from (when an input sweeps rates or two inputs are compared).

Tables give their units in the headers (ms, req/s).

Given two inputs (pipeline and monolithic), the curves share axes and the report adds a
side-by-side table at every rate both have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from mmstream import report_timeline
from mmstream.bench.config import MODES, WORKLOADS

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
        "mode": {"enum": list(MODES)},
        "workload": {"enum": list(WORKLOADS)},
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


class ReportError(RuntimeError):
    """A report cannot be written here (a missing optional dependency); says what to install."""


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
                      "| kind | n | p50 (ms) | p95 (ms) | p99 (ms) | floor (ms) | overhead p50 (ms) | overhead p95 (ms) |",
                      "|---|---|---|---|---|---|---|---|"]
            for kind, lat in run["latency_ms"].items():
                e, o = lat["e2e"], run["overhead_ms"].get(kind)
                lines.append(f"| {kind} | {e['count']} | {fmt(e.get('p50'))} | {fmt(e.get('p95'))} | "
                             f"{fmt(e.get('p99'))} | {fmt(o and o['floor_ms'])} | "
                             f"{fmt(o and o['total']['p50'])} | {fmt(o and o['total']['p95'])} |")
            lines += ["", "| kind | stage | queued p50 (ms) | queued p95 (ms) | service p50 (ms) | service p95 (ms) "
                      "| hop overhead p50 (ms) |",
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
             f"| rate (req/s) | kind | {names[0]} p50 / p95 / p99 (ms) | {names[1]} p50 / p95 / p99 (ms) | p99 ratio |",
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


LOG_RATIO = 20.0
"""Values spanning more than this ratio get a log axis: on a linear one the smallest vanish."""


def axis_scale(values: Sequence[float]) -> str:
    """``"log"`` when the positive ``values`` span more than ``LOG_RATIO``, else ``"linear"``."""
    positive = [v for v in values if v and v > 0]
    return "log" if positive and max(positive) / min(positive) > LOG_RATIO else "linear"


_PER_RUN = frozenset({"rate", "rates", "seed", "duration_s", "drain_s"})
"""Config keys that differ between the points of one line (a sweep), not between lines."""


def p99_lines(series: list[list[dict[str, Any]]], names: list[str]) -> dict[str, list[tuple[float, float]]]:
    """The lines of ``p99_vs_throughput.png``: label -> (achieved req/s, e2e p99 ms) points
    in offered-rate order. Runs of one mode and otherwise equal config join one line
    (``"<mode>: <kind>"``), whichever input file they came from; when one mode ran with
    different configs (levers off...), each config's line takes its input's name instead."""
    groups: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for name, runs in zip(names, series):
        for run in runs:
            cfg = {k: v for k, v in run["config"].items() if k not in _PER_RUN}
            groups.setdefault((run["mode"], json.dumps(cfg, sort_keys=True, default=str)), []).append((name, run))
    modes = [mode for mode, _ in groups]
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for (mode, _), members in groups.items():
        who = mode if modes.count(mode) == 1 else members[0][0]
        for _, run in members:
            for kind, lat in run["latency_ms"].items():
                e2e = lat.get("e2e", {})
                if e2e.get("count"):
                    lines.setdefault(f"{who}: {kind}", []).append((run["config"]["rate"], run["achieved_rate"], e2e["p99"]))
    return {label: [(x, y) for _, x, y in sorted(pts)] for label, pts in sorted(lines.items())}


def _plots(series: list[list[dict[str, Any]]], names: list[str], out_dir: Path) -> list[str]:
    try:
        import matplotlib
    except ImportError:  # report-only dependency: the `report` extra
        raise ReportError("plots need matplotlib: pip install -e '.[report]'") from None
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
                        ax.step(xs, ys, where="post", label=f"{name} @ {run['config']['rate']:g} req/s")
            ax.set(title=f"e2e latency CDF: {kind}", xlabel="e2e latency (ms, log scale)",
                   ylabel="fraction of requests", xscale="log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / "latency_cdf.png", dpi=100)
        plt.close(fig)
        written.append("latency_cdf.png")

    rows = []  # (label, {p50: (queued, service), p95: (...)})
    for name, runs in zip(names, series):
        if not runs:
            continue
        run = runs[0]
        for kind, lat in run["latency_ms"].items():
            for stage, st in lat["stages"].items():
                if st["service"].get("count"):
                    rows.append((f"{name} · {kind} · {stage}",
                                 {q: (st["queued"][q], st["service"][q]) for q in ("p50", "p95")}))
    if rows:
        values = [v for _, qs in rows for pair in qs.values() for v in pair]
        scale = axis_scale(values)
        fig, axes = plt.subplots(1, 2, figsize=(12, max(3.0, 0.45 * len(rows) + 1.5)), sharey=True)
        ys = range(len(rows))
        for ax, q in zip(axes, ("p50", "p95")):
            queued = [max(qs[q][0], 1e-3) for _, qs in rows]  # a log axis cannot show 0
            service = [max(qs[q][1], 1e-3) for _, qs in rows]
            ax.barh([y - 0.2 for y in ys], queued, height=0.4, label="queued", color="tab:orange")
            ax.barh([y + 0.2 for y in ys], service, height=0.4, label="service", color="tab:blue")
            ax.set(title=f"{q} per stage", xlabel=f"ms{', log scale' if scale == 'log' else ''}", xscale=scale)
            ax.grid(True, axis="x", which="both", alpha=0.3)
        axes[0].set_yticks(list(ys), [label for label, _ in rows], fontsize="small")
        axes[0].invert_yaxis()
        axes[1].legend(loc="lower right")
        fig.suptitle("where time goes per stage: waiting (queued) vs working (service), lowest rate")
        fig.tight_layout()
        fig.savefig(out_dir / "stages.png", dpi=100)
        plt.close(fig)
        written.append("stages.png")

    if len(series) > 1 or any(len(runs) > 1 for runs in series):
        lines = p99_lines(series, names)
        fig, ax = plt.subplots(figsize=(7, 5))
        # A colour per mode (or config), a line style per request kind: modes compare at a glance.
        whos = sorted({label.split(": ", 1)[0] for label in lines})
        kinds_seen = sorted({label.split(": ", 1)[1] for label in lines})
        styles = ("-", "--", ":", "-.")
        for label, pts in lines.items():
            who, kind = label.split(": ", 1)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    color=f"C{whos.index(who) % 10}", linestyle=styles[kinds_seen.index(kind) % len(styles)])
        p99s = [p[1] for pts in lines.values() for p in pts]
        scale = axis_scale(p99s)
        ax.set(xlabel="achieved throughput (req/s)", ylabel=f"e2e p99 (ms{', log scale' if scale == 'log' else ''})",
               yscale=scale, title="p99 vs throughput: one line per mode")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / "p99_vs_throughput.png", dpi=100)
        plt.close(fig)
        written.append("p99_vs_throughput.png")
    return written + report_timeline.plot(series, names, out_dir, plt)
