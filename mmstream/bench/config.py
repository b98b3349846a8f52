"""One `mmstream bench` invocation as data: ``BenchConfig`` and the parsers of its flags.

A config fixes everything a run depends on (workload, rates, seed, mode, levers), so two
runs with the same config offer the same traffic; ``config_dict`` is its JSON form, stored
in every run's report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODES = ("pipeline", "monolithic", "server")
WORKLOADS = ("text", "mixed", "chat", "chat-mm", "capacity", "images", "audio", "fairness", "retrieve", "rag",
             "retrieve-images")
SCHEDULERS = ("continuous", "static")
LM_PRECISIONS = ("q4_1", "fp32", "int8")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark invocation: a workload at one or several offered rates, in one mode."""

    workload: str = "text"
    """``text`` (one text part), ``mixed`` (``workloads.MIXED_KINDS``), ``chat`` (generate
    requests, ``workloads.CHAT_PROMPTS``), ``capacity``, ``images`` (its photos alone), ``audio``
    (spoken clips alone) or ``fairness`` (``bench.fairness``: tenant B's rt text alone, then
    beside tenant A's flood of the worst requests allowed)."""
    rate: float = 20.0
    """Offered requests per second (used when ``rates`` is empty)."""
    duration_s: float = 20.0
    """Seconds of arrivals per rate."""
    drain_s: float = 30.0
    """Seconds to wait for stragglers after the last arrival; unanswered ones count as lost."""
    seed: int = 1
    """Seeds arrivals and requests: the same seed gives both modes the same schedule."""
    lane: str = "rt"
    mode: str = "pipeline"
    """``pipeline`` (the running workers, over Kafka), ``monolithic`` (``mmstream.monolith``: one
    FIFO for every model) or ``server`` (``ModelServer``: a queue and engine thread per model)."""
    rates: tuple[float, ...] = ()
    """A sweep: one run per rate, in order. Empty: just ``rate``."""
    max_batch_size: int | None = None
    """Monolith's fixed batch size; None: ``settings.encoder.max_batch_size`` (as the encoders)."""
    max_wait_ms: float | None = None
    """Monolith's batch wait; None: ``settings.encoder.max_wait_ms`` (as the encoders)."""
    floor_repeats: int = 20
    """Batch-1 engine calls per engine for ``floor_ms`` (the median is reported)."""
    lanes: tuple[tuple[str, float], ...] = ()
    """Share of requests per lane, e.g. (("rt", 0.2), ("bulk", 0.8)). Empty: all on ``lane``."""
    repeat: float = 0.0
    """Share of requests whose content repeats an earlier request's (reuse-cache traffic)."""
    levers_off: tuple[str, ...] = ()
    """Levers switched off for this run (``mmstream.lever_names.LEVERS``); the run then gets a
    pipeline of its own with those settings."""
    scheduler: str | None = None
    """Chat workload: the generator's batching (continuous or static); the run then gets a
    pipeline of its own with that setting. None: whatever the running pipeline uses."""
    lm_precision: str | None = None
    """Chat workload: the generator's LM variant (q4_1 on llama.cpp, fp32 or int8 on ONNX
    Runtime); the run then gets a pipeline of its own. None: what the running pipeline uses."""
    chat_max_tokens: int = 32
    abuse_rate: float | None = None
    """Fairness workload: tenant A's offered requests per second. None: five times ``rate``."""
    victim_images: float = 0.0
    """Fairness workload: the share of tenant B's requests that are one photo each (the
    capacity mix's); the rest are texts. 0: texts only."""
    abuse_shapes: tuple[str, ...] = ()
    """Fairness workload: what tenant A sends (``mmstream.bench.abuse.ABUSE_SHAPES``). Empty:
    every shape the deployment serves."""
    abuse_deadline_ms: int | None = None
    """Fairness workload: the deadline of tenant A's requests. None: the longest allowed
    (``limits.max_deadline_ms``), which outlasts a run's drain: A's unanswered requests are
    then reported ``pending``, not lost."""
    docs: int = 2000
    """retrieve and rag workloads: passages of the offline corpus put into the collection."""
    own_pipeline: bool = False
    """Run against a fresh pipeline started for this run, even with every lever on."""
    rate_schedule: tuple[tuple[float, float], ...] = ()
    """(rate, seconds) segments, e.g. ((10, 30), (90, 60), (10, 60)): one run whose Poisson
    arrivals follow them in turn (``duration_s`` is then their sum); its report adds a
    timeline (``bench.timeline``). Empty: ``rate`` or ``rates``."""
    autoscale: bool = False
    """Run on a pipeline of its own with the local scaler (``mmstream.autoscaler``) running."""
    vs: str | None = None
    """A baseline mode (server or monolithic) run right after each pipeline run, ``rounds``
    times per rate: the JSON's ``paired`` has each round's ratios and their median
    (``mmstream.bench.paired``). None: ``mode`` alone."""
    rounds: int = 1
    """Runs per rate of each mode (alternating with ``vs``)."""
    tenant: str | None = None
    """Tenant of the pipeline's requests. None: a fresh one per run, so the reuse cache
    (keyed by tenant) cannot answer from an earlier run and the modes compare compute
    with compute; the ``cache`` counts of the run say what it answered within the run."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; workloads: {', '.join(WORKLOADS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")
        if self.mode == "server" and self.workload not in ("text", "capacity"):
            raise ValueError("server mode serves requests of one modality each: workload text or capacity")
        if any(r <= 0 for r in self.sweep) or self.duration_s <= 0:
            raise ValueError("rates and duration must be positive")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; schedulers: {', '.join(SCHEDULERS)}")
        if self.lm_precision is not None and self.lm_precision not in LM_PRECISIONS:
            raise ValueError(f"unknown LM precision {self.lm_precision!r}; precisions: {', '.join(LM_PRECISIONS)}")
        if self.workload == "fairness" and (self.mode != "pipeline" or self.rates or self.levers_off
                                            or self.own_pipeline or self.scheduler or self.lm_precision):
            raise ValueError("the fairness workload runs at one rate against the running pipeline (no --rates, "
                             "--mode, levers or pipeline of its own)")
        if (self.abuse_rate is not None and self.abuse_rate <= 0) or (self.abuse_deadline_ms is not None
                                                                     and self.abuse_deadline_ms <= 0):
            raise ValueError("abuse rate and deadline must be positive")
        if not 0.0 <= self.victim_images <= 1.0:
            raise ValueError(f"--victim-images is a share from 0 to 1, got {self.victim_images}")
        if self.rate_schedule and (self.rates or any(r <= 0 or d <= 0 for r, d in self.rate_schedule)):
            raise ValueError("a rate schedule is positive rate:seconds segments, and replaces --rates")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")
        if self.vs is not None and (self.vs not in ("server", "monolithic") or self.mode != "pipeline"
                                    or self.rate_schedule or self.workload in ("fairness", "retrieve", "rag",
                                                                               "retrieve-images")):
            raise ValueError("--vs pairs pipeline runs (--mode pipeline, no --rate-schedule) with a server or "
                             "monolithic run of the same traffic")
        if self.vs == "server" and self.workload not in ("text", "capacity"):
            raise ValueError("server mode serves requests of one modality each: workload text or capacity")
        if self.docs < 1:
            raise ValueError(f"--docs must be at least 1, got {self.docs}")
        if self.chat_max_tokens < 1:
            raise ValueError("chat max tokens must be at least 1")
        if not 0.0 <= self.repeat < 1.0:
            raise ValueError("repeat must be in [0, 1)")
        if self.lanes and (any(lane not in ("rt", "bulk") or share < 0 for lane, share in self.lanes)
                           or abs(sum(share for _, share in self.lanes) - 1.0) > 1e-6):
            raise ValueError("lanes must be rt/bulk shares adding up to 1, e.g. rt=0.2,bulk=0.8")

    @property
    def sweep(self) -> tuple[float, ...]:
        if self.rate_schedule:  # one run, labelled with its mean rate
            total = sum(d for _, d in self.rate_schedule)
            return (round(sum(r * d for r, d in self.rate_schedule) / total, 3),)
        return tuple(self.rates) or (self.rate,)



def parse_rates(text: str) -> tuple[float, ...]:
    """``"5,10,20"`` -> ``(5.0, 10.0, 20.0)``; raises ``ValueError`` on anything else."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        rates = ()
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates takes positive numbers separated by commas, got {text!r}")
    return rates



def parse_rate_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """``"10:30,90:60"`` -> ``((10.0, 30.0), (90.0, 60.0))``: rate:seconds segments; raises
    ``ValueError`` on anything else."""
    try:
        out = tuple((float(r), float(d)) for r, d in (seg.split(":") for seg in text.split(",") if seg.strip()))
    except ValueError:
        out = ()
    if not out or any(r <= 0 or d <= 0 for r, d in out):
        raise ValueError(f"--rate-schedule takes RATE:SECONDS segments separated by commas, got {text!r}")
    return out


def parse_lanes(text: str) -> tuple[tuple[str, float], ...]:
    """``"rt=0.2,bulk=0.8"`` -> ``(("rt", 0.2), ("bulk", 0.8))``; raises ``ValueError``."""
    out = []
    for item in text.split(","):
        lane, sep, share = item.partition("=")
        if not sep:
            raise ValueError(f"--lanes takes LANE=SHARE,..., got {text!r}")
        out.append((lane.strip(), float(share)))
    return tuple(out)



def config_dict(cfg: BenchConfig) -> dict[str, Any]:
    """``cfg`` as the JSON a report stores (``rates`` always lists the sweep)."""
    d = asdict(cfg)
    d["rates"] = list(cfg.sweep)
    return d
