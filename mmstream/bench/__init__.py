"""`mmstream bench`: open-loop Poisson arrivals against the running pipeline, or against the
monolithic baseline (``mmstream.monolith``) fed by the very same schedule.

Both modes draw the same arrival times and the same requests from ``seed``, and both
state ``floor_ms``: each engine's service time alone at batch 1, measured in this process
before the run, so a report can say how much of the latency is not compute.

Output: one run dict per rate (schema: ``mmstream.report.RUN_SCHEMA``); a sweep (several
rates) returns ``{"mode", "workload", "seed", "config", "runs": [run, ...]}``
(``mmstream.report.SWEEP_SCHEMA``).

One module per concern, read in this order:

- ``config``: ``BenchConfig``, one invocation as data, and the parsers of its flags;
- ``workloads``: the traffic: arrivals, request generators, sample media, ``schedule``;
- ``run``: sending the schedule to the pipeline or the monolith, and process accounting;
- ``results``: each request's ``Record`` and the run's JSON (``build_run``, ``overhead``);
- ``fairness`` and ``fairness_run``: the fairness workload (tenant B's rt text alone, then
  beside tenant A's flood of the worst requests allowed): its traffic and report, and its run;
- ``cli``: the command (``cli_main``, ``bench compare``).

Every public name is importable from this package.
"""

from mmstream.bench.cli import cli_main, compare, config_from_args
from mmstream.bench.config import MODES, SCHEDULERS, WORKLOADS, BenchConfig, config_dict, parse_lanes, parse_rates
from mmstream.bench.fairness import ABUSE_SHAPES, AbuseBounds, abuse_request, abuser_plan, victim_schedule
from mmstream.bench.fairness_run import run_fairness
from mmstream.bench.results import Record, build_run, overhead
from mmstream.bench.run import proc_cpu_s, proc_peak_rss_mb, run_bench
from mmstream.bench.workloads import (
    CHAT_PROMPTS,
    FLOOR_TEXT_WORDS,
    MIXED_KINDS,
    SAMPLE_PHOTOS,
    WORDS,
    arrival_offsets,
    chat_request,
    floor_text,
    mixed_request,
    request_kind,
    sample_images,
    schedule,
    text_request,
)

__all__ = [
    "ABUSE_SHAPES", "AbuseBounds", "abuse_request", "abuser_plan", "run_fairness", "victim_schedule",
    "CHAT_PROMPTS", "FLOOR_TEXT_WORDS", "MIXED_KINDS", "MODES", "SAMPLE_PHOTOS", "SCHEDULERS", "WORDS",
    "WORKLOADS", "BenchConfig", "Record", "arrival_offsets", "build_run", "chat_request", "cli_main",
    "compare", "config_dict", "config_from_args", "floor_text", "mixed_request", "overhead",
    "parse_lanes", "parse_rates", "proc_cpu_s", "proc_peak_rss_mb", "request_kind", "run_bench",
    "sample_images", "schedule", "text_request",
]
