"""The `mmstream bench` command: a run from its flags, and `bench compare` of saved runs.

stdout carries the JSON only (progress and "wrote ..." lines go to stderr), so the output
can be piped into a file or ``jq``. Exit codes: 0 done, 1 a request was lost, 2 a bad flag
or an input that is not a valid bench JSON. The fairness workload adds a short table of
its phases on stderr.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from mmstream import report
from mmstream.bench.config import BenchConfig, parse_lanes, parse_rate_schedule, parse_rates
from mmstream.bench.fairness import text_table
from mmstream.bench.fairness_run import run_fairness
from mmstream.bench.paired import text_table as paired_table
from mmstream.bench.retrieval_run import run_retrieval
from mmstream.bench.run import run_bench
from mmstream.lever_names import LEVERS
from schemas.settings import Settings


def config_from_args(args: Any) -> BenchConfig:
    """A ``BenchConfig`` from the parsed ``mmstream bench`` arguments (see ``cli_main``).
    Raises ``ValueError`` on a bad value."""
    schedule = parse_rate_schedule(args.rate_schedule) if getattr(args, "rate_schedule", None) else ()
    return BenchConfig(workload=args.workload, rate=args.rate,
                       duration_s=sum(d for _, d in schedule) if schedule else args.duration, drain_s=args.drain,
                       seed=args.seed, lane=args.lane, mode=args.mode,
                       rates=parse_rates(args.rates) if args.rates else (),
                       max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                       lanes=parse_lanes(args.lanes) if getattr(args, "lanes", None) else (),
                       repeat=getattr(args, "repeat", 0.0) or 0.0,
                       levers_off=tuple(lv for lv in LEVERS
                                        if getattr(args, f"no_{lv}", False)),
                       own_pipeline=getattr(args, "own_pipeline", False),
                       scheduler=getattr(args, "scheduler", None),
                       lm_precision=getattr(args, "lm_precision", None),
                       chat_max_tokens=getattr(args, "chat_max_tokens", None) or 32,
                       abuse_rate=getattr(args, "abuse_rate", None),
                       abuse_deadline_ms=getattr(args, "abuse_deadline_ms", None),
                       abuse_shapes=tuple(x.strip() for x in (getattr(args, "abuse_shapes", None) or "").split(",")
                                          if x.strip()),
                       victim_images=getattr(args, "victim_images", None) or 0.0,
                       docs=getattr(args, "docs", None) or 2000,
                       rate_schedule=schedule,
                       autoscale=getattr(args, "autoscale", False),
                       vs=getattr(args, "vs", None), rounds=getattr(args, "rounds", None) or 1)


def cli_main(args: Any, settings: Settings) -> int:
    """``mmstream bench [run] ...`` and ``mmstream bench compare A.json [B.json] --report DIR``.

    run: runs the benchmark, prints the JSON (and writes it to ``--out``), and with
    ``--report DIR`` writes the report there; exits 1 when a request was lost.
    compare: validates the given JSONs and writes the report of all of them to ``--report``
    (default ``bench-report``); exits 2 when one does not validate.
    """
    if getattr(args, "action", "run") == "compare":
        return compare(args)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"mmstream: {exc}", file=sys.stderr)
        return 2
    if cfg.workload == "fairness":
        return _fairness(args, settings, cfg)
    if cfg.workload in ("retrieve", "rag", "retrieve-images"):
        return _retrieval(args, settings, cfg)
    doc = asyncio.run(run_bench(settings, cfg))
    report.validate(doc)
    _emit(args, doc)
    if doc.get("paired"):
        print(paired_table(doc["paired"]), file=sys.stderr)
    if args.report:
        print(f"wrote {report.write_report([doc], Path(args.report))}", file=sys.stderr)
    runs = doc.get("runs", [doc])
    return 0 if all(r["requests"]["lost"] == 0 for r in runs) else 1


def _fairness(args: Any, settings: Settings, cfg: BenchConfig) -> int:
    """The fairness run: its JSON on stdout, its short table on stderr, B's two phases as the
    report (``--report``); exits 1 when B or A lost a request."""
    doc = asyncio.run(run_fairness(settings, cfg))
    phases = [doc["phases"]["alone"], doc["phases"]["flood"]]
    for run in phases:
        report.validate(run)
    _emit(args, doc)
    print(text_table(doc), file=sys.stderr)
    if args.report:
        path = report.write_report(phases, Path(args.report), labels=["B alone", "B beside A's flood"])
        print(f"wrote {path}", file=sys.stderr)
    lost = doc["victim"]["lost"]["alone"] + doc["victim"]["lost"]["flood"] + doc["abuser"]["lost"]
    return 0 if lost == 0 else 1


def _retrieval(args: Any, settings: Settings, cfg: BenchConfig) -> int:
    """retrieve and rag (``bench.retrieval_run``), retrieve-images (``bench.retrieval_images``):
    the JSON on stdout; exits 1 when a request was lost."""
    if cfg.workload == "retrieve-images":
        from mmstream.bench.retrieval_images import run_image_retrieval

        doc = asyncio.run(run_image_retrieval(settings, cfg))
    else:
        doc = asyncio.run(run_retrieval(settings, cfg))
    _emit(args, doc)
    return 0 if all(r["requests"]["lost"] == 0 for r in doc["runs"]) else 1


def _emit(args: Any, doc: dict[str, Any]) -> None:
    """``doc`` as JSON on stdout (and into ``--out``)."""
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    print(text)  # stdout carries the JSON only


def compare(args: Any) -> int:
    """``mmstream bench compare``: the report of ``args.inputs`` (bench JSON files) written to
    ``args.report``; 0 when written, 2 (one sentence on stderr) when an input is unreadable
    or does not validate."""
    try:
        if not args.inputs:
            raise ValueError("bench compare needs one or more bench JSON files")
        docs = [_read_json(Path(p)) for p in args.inputs]
        path = report.write_report(docs, Path(args.report or "bench-report"),
                                   labels=_compare_labels(docs, [Path(p) for p in args.inputs]))
    except (ValueError, OSError) as exc:  # BenchSchemaError is a ValueError
        print(f"mmstream: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None


def _compare_labels(docs: list[dict[str, Any]], paths: list[Path]) -> list[str]:
    """Each input's label in the report: its mode, with the file's stem when modes repeat."""
    modes = [d.get("mode", "?") for d in docs]
    return [m if modes.count(m) == 1 else f"{m} ({p.stem})" for m, p in zip(modes, paths)]
