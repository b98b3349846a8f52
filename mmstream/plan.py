"""`mmstream plan`: replicas, partitions and utilisation for a target rate, from measured cost.

The cost is what a bench run measured (``mmstream bench ... --out run.json``): each process's
CPU seconds over the run (``cpu.per_process_s``) divided by the requests it answered, so CPU
ms per request per stage, for the run's workload mix, levers and placement. For a target rate
(same mix) a stage needs ``rate x ms / 1000`` cores; it gets
``ceil(cores / (threads x target_util))`` replicas (at least one), partitions are the most
replicas of any stage (rounded up to the configured count), and the machines' utilisation is
the sum over every process, broker and Redis included, against ``machines x cores``. The
capacity it states is the rate at which that sum reaches ``target_util`` (and 100%).

Where it stops being trustworthy, and says so in its output:
- a mix, lever set or placement other than the run's (the cost per request moves with them);
- a target far from the measured rate: idle processes' cost is spread over fewer requests at
  low rates (40 ms per request at 10 req/s against 17 at 90 on this box), and queueing, not
  CPU, bounds latency near 100%;
- more than one machine: the broker's cost per request is measured on one node, and network
  hops are not in the run;
- cores that are hyperthreads, or shared with other work.
Pure but ``load_run``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

INFRA = ("broker", "redis")


@dataclass(frozen=True)
class StagePlan:
    stage: str
    ms_per_request: float
    cores: float
    replicas: int


@dataclass(frozen=True)
class Plan:
    rate: float
    stages: list[StagePlan]
    partitions: int
    utilisation: float
    """Busy cores over all cores of all machines, at ``rate``."""
    capacity_at_target: float
    capacity_at_full: float
    measured_rate: float
    warnings: list[str]


def stage_costs(run: Mapping[str, Any]) -> tuple[dict[str, float], float]:
    """(stage -> CPU ms per answered request, summed over its replicas; the run's rate)."""
    ok = run["requests"]["ok"]
    if not ok:
        raise ValueError("the run answered no request: no cost per request to plan from")
    out: dict[str, float] = {}
    for name, seconds in run["cpu"]["per_process_s"].items():
        stage = re.sub(r"\[\d+\]$", "", name)
        out[stage] = out.get(stage, 0.0) + seconds * 1000.0 / ok
    return out, float(run.get("achieved_rate") or run["config"]["rate"])


def make_plan(costs: Mapping[str, float], measured_rate: float, rate: float, *, machines: int = 1,
              cores: int = 2, threads: Mapping[str, int] | None = None, target_util: float = 0.7,
              partitions: int = 1, idle_below_ms: float = 0.5) -> Plan:
    if rate <= 0 or machines < 1 or cores < 1 or not 0 < target_util <= 1:
        raise ValueError("rate, machines and cores must be positive, target_util in (0, 1]")
    threads = dict(threads or {})
    stages, busy = [], 0.0
    for stage, ms in sorted(costs.items(), key=lambda kv: -kv[1]):
        need = rate * ms / 1000.0
        busy += need
        if stage in INFRA:
            n = 1
        elif ms < idle_below_ms:  # an idle pool in this mix (its cost is its own polling)
            n = 1
        else:
            n = max(1, math.ceil(need / (max(1, threads.get(stage, 1)) * target_util)))
        stages.append(StagePlan(stage, round(ms, 3), round(need, 3), n))
    total_ms = sum(costs.values())
    all_cores = machines * cores
    warnings = []
    if not 0.5 <= rate / measured_rate <= 2.0:
        warnings.append(f"the target {rate:g} req/s is far from the measured {measured_rate:g}: fixed costs and "
                        "queueing move the cost per request; measure nearer the target")
    if machines > 1:
        warnings.append("more than one machine: the broker's cost is one node's, and network hops are not measured")
    scaled = [s for s in stages if s.stage not in INFRA]
    return Plan(rate, stages, max(partitions, max((s.replicas for s in scaled), default=1)),
                round(busy / all_cores, 3), round(all_cores * target_util * 1000.0 / total_ms, 1),
                round(all_cores * 1000.0 / total_ms, 1), measured_rate, warnings)


def render(plan: Plan, machines: int, cores: int) -> str:
    lines = [f"plan for {plan.rate:g} req/s on {machines} machine(s) x {cores} cores, from a run at "
             f"{plan.measured_rate:g} req/s (same mix, levers and placement)",
             f"{'stage':<16}{'CPU ms/request':>15}{'cores':>8}{'replicas':>10}"]
    lines += [f"{s.stage:<16}{s.ms_per_request:>15.2f}{s.cores:>8.2f}{s.replicas:>10}" for s in plan.stages]
    lines += [f"partitions per stage topic: {plan.partitions}",
              f"utilisation: {plan.utilisation:.0%} of all cores",
              f"capacity: {plan.capacity_at_target:g} req/s at the target utilisation, {plan.capacity_at_full:g} at "
              "100% (CPU only: latency bounds bite first near it)"]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def load_run(path: Path, rate: float | None = None) -> dict[str, Any]:
    """One run of a bench JSON: the run itself, or a sweep's run at ``rate`` (its highest
    answered rate by default)."""
    doc = json.loads(Path(path).read_text())
    runs = doc.get("runs", [doc])
    if rate is not None:
        picked = [r for r in runs if r["config"]["rate"] == rate]
        if not picked:
            raise ValueError(f"{path} has no run at {rate:g} req/s (it has {[r['config']['rate'] for r in runs]})")
        return picked[0]
    return max(runs, key=lambda r: r["config"]["rate"])
