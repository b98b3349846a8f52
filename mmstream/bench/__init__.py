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

# Every public name is importable from this package, but loaded on first use (PEP 562): the
# command line imports ``bench.config`` for its flags, and a worker started through it must not
# pay for the runner, the monolith and its engines (docs/autoscaling.md: cold starts).
_WHERE = {
    "cli": ("cli_main", "compare", "config_from_args"),
    "config": ("MODES", "SCHEDULERS", "WORKLOADS", "BenchConfig", "config_dict", "parse_lanes", "parse_rates"),
    "fairness": ("ABUSE_SHAPES", "AbuseBounds", "abuse_request", "abuser_plan", "victim_schedule"),
    "fairness_run": ("run_fairness",),
    "results": ("Record", "build_run", "overhead"),
    "run": ("CpuTally", "proc_cpu_s", "proc_peak_rss_mb", "run_bench"),
    "workloads": ("CHAT_PROMPTS", "FLOOR_TEXT_WORDS", "MIXED_KINDS", "SAMPLE_PHOTOS", "WORDS", "arrival_offsets",
                  "chat_request", "floor_text", "mixed_request", "request_kind", "sample_images", "schedule",
                  "text_request"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
