"""`mmstream scale`: what the local scaler manages and what it last did (or, with ``--keda``,
the ScaledObjects the same settings generate for Kubernetes)."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from mmstream.errors import UserError
from mmstream.k8s_scalers import render, scaled_objects
from mmstream.supervisor import AUTOSCALER, Supervisor
from schemas.settings import Settings


def last_decisions(log_file: Path, n: int) -> list[dict]:
    """The last ``n`` decisions of the scaler's log, oldest first; a torn last line is skipped."""
    try:
        lines = log_file.read_text().splitlines()[-max(0, n):] if n > 0 else []
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def cmd_scale(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    if args.keda:
        print(render(scaled_objects(settings)), end="")
        return 0
    sup = Supervisor(settings)
    workers = [w for w in sup.workers() if w.alive]
    live = Counter(w.stage for w in workers)
    running = live.get(AUTOSCALER, 0) > 0
    print(f"scaler  {'running' if running else 'not running (start it with: mmstream up --autoscale)'}  "
          f"every {settings.autoscale.interval_s:g} s, up after {settings.autoscale.up_window_s:g} s, "
          f"down after {settings.autoscale.down_window_s:g} s, idle pools stop after {settings.autoscale.idle_s:g} s")
    for stage, (low, high) in settings.autoscale.limits().items():
        print(f"pool    {stage:<14} replicas={live.get(stage, 0)}  min={low} max={high}")
    for d in last_decisions(sup.dir / "autoscale.jsonl", args.last):
        held = "  (held)" if d.get("held") else ""
        at = d.get("at")
        when = time.strftime("%H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else "?"
        print(f"decided {when}  {d.get('stage', '?'):<14} {d.get('from')} -> {d.get('to')}  {d.get('reason')}, "
              f"demand {d.get('demand')}{held}")
    return 0


def cmd_plan(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    import os

    from mmstream import plan as P

    try:
        run = P.load_run(args.run_file, args.run_rate)
        costs, measured = P.stage_costs(run)
        cores = args.cores or os.cpu_count() or 1
        threads = {stage: settings.encoder.intra_op_threads or cores for stage in costs if stage.startswith("encode.")}
        threads["generate"] = settings.generator.threads or cores
        result = P.make_plan(costs, measured, args.rate, machines=args.machines, cores=cores, threads=threads,
                             target_util=args.target_util, partitions=settings.kafka.partitions)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot plan from {args.run_file}: {exc}") from None
    print(P.render(result, args.machines, cores))
    return 0
