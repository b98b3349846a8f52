"""Prometheus metrics of every worker: one ``Metrics`` object per process, on a registry
passed in, so importing this module registers nothing and tests get a clean registry each.

Naming follows Prometheus practice: prefix ``mmstream_``, base units (seconds), ``_total``
on counters, and only low-cardinality labels. Label values are drawn from small fixed
sets; never put a request id, a raw tenant or text in a label (each distinct value is a new
time series kept in memory by the worker and by Prometheus). The one per-tenant count
(``tenant_shed``) takes its label from ``TenantLabels``: a bounded set of names, then ``other``.

Label values used across the pipeline:

- ``stage``: the span names of ``schemas.trace``: ``route``, ``encode.<modality>``,
  ``assemble``, ``generate``, plus ``lagmon`` for the lag monitor.
- ``modality``: ``text`` | ``image`` | ``audio`` | ``video``, or ``mixed`` for a request
  whose parts have more than one (``request_modality`` picks it).
- ``lane``: ``rt`` | ``bulk``.
- ``outcome`` (``OUTCOMES``), cache ``result`` (``CACHE_RESULTS``), admission ``decision``
  (``DECISIONS``) and error ``code`` (``schemas.errors.ErrorCode``) are checked: a value
  outside its set raises ``ValueError``, so a stray label value fails a test, not Prometheus.

What a stage calls, one line each (times are milliseconds, as the trace records them; the
helpers convert to seconds):

- when a stage finishes an item: ``observe_span(stage, modality, lane, queued_ms, service_ms)``
  and ``request_done(stage, outcome, code=None)``;
- when a batch runs: ``observe_batch(stage, n)``;
- at the terminal event of a request: ``observe_e2e(modality, lane, e2e_ms)``; the generator
  also ``observe_ttft(lane, ms)`` once and ``observe_tpot(lane, ms)`` per request;
- ``cache_lookup(modality, result)``, ``admission(lane, decision)``, ``to_dlq(stage)``;
  ``tenant_shed(tenant_label, reason)`` when a tenant's quota sheds a request (the one
  tenant label, from a bounded set: the first ``quota.metric_tenants`` tenants, then ``other``),
  and ``tenant_paced(tenant_label, seconds, new, reason)`` when the router's pacing holds a tenant;
- gauges: ``set_inflight(stage, n)`` or ``with track_inflight(stage):``,
  ``set_queue_depth(stage, lane, n)``; the lag monitor calls ``set_consumer_lag(rows)``;
- once after the engine warms up: ``set_engine(stage, engine_info_dict)``; before that, each
  variant the fidelity gate or a failed load refused: ``engine_fallback(stage, from_, to, reason)``.

- ``mmstream_inflight`` needs no call from a Faust stage: the app factory counts the records
  each stage holds (consumed, not yet acknowledged) into the process's ``WorkerHealth``;
  ``set_inflight``/``track_inflight`` add counts of a stage's own.

Every registry also carries the process collector (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, open fds, start time) and ``mmstream_ready`` (1 while the
worker's readiness checks pass), so the dashboard shows per-worker health.

``streams.observe.http.serve(port, registry)`` exposes a registry over HTTP for Prometheus to scrape, with
``/healthz`` and ``/readyz`` beside ``/metrics`` (``streams.observe.health``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from schemas.errors import ErrorCode
from streams.observe.health import WorkerHealth, process_health
from streams.policies import quota
from workers.engines.gate import FALLBACK_REASONS

# 0.5 ms to 30 s, roughly 1-2-5 per decade: a text embedding takes a few ms, a bulk video
# request tens of seconds. Deadlines above 30 s land in +Inf, which is still counted.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)
# Powers of two: up to four times the default encoder max_batch_size (16), so a raised
# limit still lands in a finite bucket.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

OUTCOMES = frozenset({"ok", "error", "dlq"})
"""``ok``: the item went on (or was answered); ``error``: it was answered with an error
event; ``dlq``: it could not be decoded and went to the dead-letter topic."""
CACHE_RESULTS = frozenset({"hit", "miss", "error"})
DECISIONS = frozenset({"admit", "defer", "reject"})
SHED_REASONS = quota.SHED_REASONS
PACE_REASONS = frozenset({"large_records", "refused"})
ERROR_CODES = frozenset(str(c) for c in ErrorCode)
ENGINE_FIELDS = ("model", "version", "precision", "provider", "backend")
MIXED = "mixed"


class MetricSchema(NamedTuple):
    """One metric family as defined here (before exposition suffixes)."""

    type: str
    """``histogram`` | ``counter`` | ``gauge`` | ``info``."""
    labels: tuple[str, ...]
    """Labels of its series; for an info, its own labels plus the info's keys."""


_TYPES: dict[type, str] = {Histogram: "histogram", Counter: "counter", Gauge: "gauge", Info: "info"}
_C = TypeVar("_C", Histogram, Counter, Gauge, Info)


STATE_KINDS = frozenset({"open", "orphans", "tombstones", "active", "done", "keys"})
"""What ``mmstream_state_entries`` counts (a fixed set: labels stay low-cardinality)."""

class LagSample(Protocol):
    """What ``set_consumer_lag`` reads from each row (``streams.observe.lagmon.LagRow`` is one)."""

    group: str
    topic: str
    partition: int
    lag: int


class Metrics:
    """Every collector of mmstream, created on ``registry`` (a new one by default).

    A process makes one and passes it to its stages; two ``Metrics`` on one registry would
    clash (``ValueError: Duplicated timeseries``) — that is the point of passing it in.
    """

    def __init__(self, registry: CollectorRegistry | None = None, health: WorkerHealth | None = None) -> None:
        """``health``: where readiness and counted in-flight items come from (default: the
        process's, ``streams.observe.health.process_health()``)."""
        self.registry = CollectorRegistry() if registry is None else registry
        self.health = process_health() if health is None else health
        # Every family by name with its type and the labels of its series: the dashboard
        # test checks each query against it, so dashboard and code cannot drift apart.
        self.schema: dict[str, MetricSchema] = {}
        lat = {"buckets": LATENCY_BUCKETS_S}
        self.stage_queue_seconds = self._make(
            Histogram, "mmstream_stage_queue_seconds",
            "Time an item waited before a stage started on it: broker hop plus in-worker queue.",
            ("stage", "modality", "lane"), **lat)
        self.stage_service_seconds = self._make(
            Histogram, "mmstream_stage_service_seconds",
            "Time a stage spent working on an item (for a batch: the batch's time).",
            ("stage", "modality", "lane"), **lat)
        self.batch_size = self._make(
            Histogram, "mmstream_batch_size", "Items per engine call.", ("stage",), buckets=BATCH_BUCKETS)
        self.e2e_seconds = self._make(
            Histogram, "mmstream_e2e_seconds", "Client send to terminal event of a request.",
            ("modality", "lane"), **lat)
        self.ttft_seconds = self._make(
            Histogram, "mmstream_ttft_seconds", "Client send to the first generated token.", ("lane",), **lat)
        self.tpot_seconds = self._make(
            Histogram, "mmstream_tpot_seconds", "Mean time per output token after the first, per request.",
            ("lane",), **lat)

        # Counters are named without `_total`: prometheus_client appends it on exposition.
        self.requests_total = self._make(
            Counter, "mmstream_requests", "Items a stage finished (requests; part jobs at encoders), by outcome.",
            ("stage", "outcome"))
        self.errors_total = self._make(
            Counter, "mmstream_errors", "Error events a stage emitted, by stable error code.", ("stage", "code"))
        self.cache_requests_total = self._make(
            Counter, "mmstream_cache_requests",
            "Reuse-cache lookups by result (error: the cache failed, costing time only).", ("modality", "result"))
        self.admission_decisions_total = self._make(
            Counter, "mmstream_admission_decisions", "Admission decisions on incoming requests.",
            ("lane", "decision"))
        self.dlq_total = self._make(
            Counter, "mmstream_dlq", "Records a stage sent to the dead-letter topic.", ("stage",))
        self.dlq_dropped_total = self._make(
            Counter, "mmstream_dlq_dropped", "Bad records not parked in the DLQ: their tenant's DLQ budget "
            "(dlq.tenant_rate_per_s) was spent.", ("stage",))
        self.tenant_shed_total = self._make(
            Counter, "mmstream_tenant_shed",
            "Requests the router shed for their tenant's quota, by reason (rate, queued); the tenant label names a "
            "bounded set of tenants (quota.metric_tenants), the rest are `other`.", ("tenant", "reason"))
        self.tenant_paced_total = self._make(
            Counter, "mmstream_tenant_paced",
            "Times the router began holding a tenant's ingress topics while other tenants were served, by reason: "
            "large_records (router.large_record_bytes_per_s), refused (router.refused_per_s); tenant label as "
            "mmstream_tenant_shed.", ("tenant", "reason"))
        self.tenant_paced_seconds = self._make(
            Counter, "mmstream_tenant_paced_seconds",
            "Seconds the router held a tenant's ingress topics (its records waited in its own topics meanwhile), by "
            "the reason that held it longer; tenant label as mmstream_tenant_shed.", ("tenant", "reason"))
        self.engine_fallbacks_total = self._make(
            Counter, "mmstream_engine_fallbacks",
            "Engine variants (from) a stage refused at start for the next one (to), by reason: "
            "missing, fidelity, load_failed, provider; provider_failed when the runtime skipped a provider.",
            ("stage", "from", "to", "reason"))

        self.consumer_lag = self._make(
            Gauge, "mmstream_consumer_lag",
            "Records not yet committed by a consumer group (end offset minus committed).",
            ("topic", "partition", "group"))
        # Computed at scrape time from the process's health (see the module docstring).
        self._own_inflight: dict[str, int] = {}
        self._inflight_lock = threading.Lock()
        self._worker = _WorkerCollector(self)
        self.registry.register(self._worker)
        self.schema["mmstream_inflight"] = MetricSchema("gauge", ("stage",))
        self.schema["mmstream_ready"] = MetricSchema("gauge", ("stage",))
        self.schema["mmstream_cold_start_seconds"] = MetricSchema("gauge", ("stage", "phase"))
        ProcessCollector(registry=self.registry)
        self.queue_depth = self._make(
            Gauge, "mmstream_queue_depth", "Items waiting in a stage's in-process queue.", ("stage", "lane"))
        self.state_entries = self._make(
            Gauge, "mmstream_state_entries",
            "Entries a stage keeps in memory, by kind: the assembler's open requests, orphans (parts without a "
            "manifest) and tombstones (answered, kept against late duplicates); the generator's active and done.",
            ("stage", "kind"))
        self.cpu_nice = self._make(
            Gauge, "mmstream_cpu_nice",
            "The CPU priority (Linux nice) a stage's process runs at now: its local.nice value, or 0 while a raised "
            "router has stepped back for a box past capacity (router.step_back_rate).", ("stage",))
        self.cpu_lowered_total = self._make(
            Counter, "mmstream_cpu_lowered",
            "Times a stage's process moved quota.debt_nice below its level to run work admitted over its tenant's "
            "compute bucket alone (a generation; a pool's batch of nothing else, with no other job waiting).",
            ("stage",))
        self.task_restarts_total = self._make(
            Counter, "mmstream_task_restarts",
            "Times a stage's long-running task (poll, sweep, step loop) raised and was started again.",
            ("stage", "task"))
        self.engine = self._make(
            Info, "mmstream_engine", "Engine a stage serves: model, version, precision, provider, backend.",
            ("stage",), info_keys=ENGINE_FIELDS)
        self._lag_keys: set[tuple[str, str, str]] = set()

    def _make(self, cls: type[_C], name: str, doc: str, labels: tuple[str, ...],
              info_keys: tuple[str, ...] = (), **kw: Any) -> _C:
        collector = cls(name, doc, labels, registry=self.registry, **kw)
        self.schema[name] = MetricSchema(_TYPES[cls], labels + info_keys)
        return collector

    # -- latency and throughput -------------------------------------------------------

    def observe_span(self, stage: str, modality: str, lane: str, queued_ms: float, service_ms: float) -> None:
        """Record one item's queue and service time at ``stage`` (milliseconds, >= 0)."""
        self.stage_queue_seconds.labels(stage, modality, lane).observe(max(0.0, queued_ms) / 1000.0)
        self.stage_service_seconds.labels(stage, modality, lane).observe(max(0.0, service_ms) / 1000.0)

    def observe_batch(self, stage: str, n: int) -> None:
        """Record that ``stage`` ran an engine call on ``n`` items."""
        self.batch_size.labels(stage).observe(n)

    def observe_e2e(self, modality: str, lane: str, e2e_ms: float) -> None:
        """Record a request's end-to-end time, once, where its terminal event is sent."""
        self.e2e_seconds.labels(modality, lane).observe(max(0.0, e2e_ms) / 1000.0)

    def observe_ttft(self, lane: str, ttft_ms: float) -> None:
        """Record a generate request's time to first token, once per request."""
        self.ttft_seconds.labels(lane).observe(max(0.0, ttft_ms) / 1000.0)

    def observe_tpot(self, lane: str, tpot_ms: float) -> None:
        """Record a generate request's mean time per output token, once per request."""
        self.tpot_seconds.labels(lane).observe(max(0.0, tpot_ms) / 1000.0)

    # -- counters ---------------------------------------------------------------------

    def request_done(self, stage: str, outcome: str, code: str | None = None) -> None:
        """Count one item finished by ``stage``; with ``code``, also count the error.

        Raises ``ValueError`` if ``outcome`` is not in ``OUTCOMES`` or ``code`` is not an
        ``ErrorCode`` value.
        """
        _check("outcome", outcome, OUTCOMES)
        if code is not None:
            _check("code", str(code), ERROR_CODES)
        self.requests_total.labels(stage, outcome).inc()
        if outcome == "ok":
            self.health.mark("first_answer")
        if code is not None:
            self.errors_total.labels(stage, str(code)).inc()

    def dlq_dropped(self, stage: str) -> None:
        """Count a bad record ``stage`` did not park because its tenant's DLQ budget was spent."""
        self.dlq_dropped_total.labels(stage).inc()

    def to_dlq(self, stage: str) -> None:
        """Count a record ``stage`` sent to the DLQ, and the item as finished with outcome ``dlq``."""
        self.dead_lettered(stage)
        self.requests_total.labels(stage, "dlq").inc()

    def dead_lettered(self, stage: str) -> None:
        """Count a record ``stage`` sent to the DLQ whose item was counted otherwise (answered
        with an error, and parked too)."""
        self.dlq_total.labels(stage).inc()

    def engine_fallback(self, stage: str, from_: str, to: str, reason: str) -> None:
        """Count one refused engine variant (or skipped provider) of ``stage``: ``from_`` and
        ``to`` are precisions (provider names for ``provider_failed``; ``to`` is "none" when
        nothing was left). Raises ``ValueError`` when ``reason`` is not in ``FALLBACK_REASONS``."""
        _check("reason", reason, FALLBACK_REASONS)
        self.engine_fallbacks_total.labels(stage, from_, to, reason).inc()

    def cache_lookup(self, modality: str, result: str) -> None:
        """Count one reuse-cache lookup; ``result`` is ``hit``, ``miss`` or ``error``."""
        _check("result", result, CACHE_RESULTS)
        self.cache_requests_total.labels(modality, result).inc()

    def admission(self, lane: str, decision: str) -> None:
        """Count one admission decision: ``admit``, ``defer`` or ``reject``."""
        _check("decision", decision, DECISIONS)
        self.admission_decisions_total.labels(lane, decision).inc()

    def tenant_shed(self, tenant_label: str, reason: str) -> None:
        """Count one request shed for its tenant's quota. ``tenant_label`` must come from a
        bounded mapping (``streams.policies.quota.TenantLabels``), never the raw tenant."""
        _check("reason", reason, SHED_REASONS)
        self.tenant_shed_total.labels(tenant_label, reason).inc()

    def tenant_paced(self, tenant_label: str, seconds: float, new: bool, reason: str) -> None:
        """Count ``seconds`` more of a tenant's hold by the router's pacing for ``reason``
        (``new``: a hold began). ``tenant_label`` as for ``tenant_shed``."""
        _check("reason", reason, PACE_REASONS)
        if new:
            self.tenant_paced_total.labels(tenant_label, reason).inc()
        self.tenant_paced_seconds.labels(tenant_label, reason).inc(seconds)

    # -- gauges -----------------------------------------------------------------------

    def set_inflight(self, stage: str, n: int) -> None:
        """Set how many items ``stage`` holds now (for stages that count them themselves);
        added to what the app factory counts for it."""
        with self._inflight_lock:
            self._own_inflight[stage] = n

    def track_inflight(self, stage: str) -> AbstractContextManager[None]:
        """``with metrics.track_inflight(stage):`` raises the gauge for the block's duration."""
        return self._track(stage)

    @contextmanager
    def _track(self, stage: str) -> Iterator[None]:
        with self._inflight_lock:
            self._own_inflight[stage] = self._own_inflight.get(stage, 0) + 1
        try:
            yield
        finally:
            with self._inflight_lock:
                self._own_inflight[stage] -= 1

    def inflight(self) -> dict[str, int]:
        """Items held per stage: counted by the app factory plus set by the stage itself."""
        with self._inflight_lock:
            total = dict(self._own_inflight)
        for stage, n in self.health.inflight().items():
            total[stage] = total.get(stage, 0) + n
        return total

    def set_state(self, stage: str, **kinds: int) -> None:
        """How many entries of each kind ``stage`` keeps in memory now."""
        for kind, n in kinds.items():
            _check("kind", kind, STATE_KINDS)
            self.state_entries.labels(stage=stage, kind=kind).set(n)

    def set_cpu_nice(self, stage: str, nice: int, lowered: bool = False) -> None:
        """The CPU priority ``stage``'s process runs at now; ``lowered``: moved down for work
        admitted in debt (``streams.runtime.priority.Lowered``)."""
        self.cpu_nice.labels(stage).set(nice)
        if lowered:
            self.cpu_lowered_total.labels(stage).inc()

    def task_restart(self, stage: str, task: str) -> None:
        self.task_restarts_total.labels(stage=stage, task=task).inc()

    def set_queue_depth(self, stage: str, lane: str, n: int) -> None:
        """Set how many items wait in ``stage``'s in-process queue of ``lane``."""
        self.queue_depth.labels(stage, lane).set(n)

    def set_consumer_lag(self, rows: Iterable[LagSample]) -> None:
        """Replace the lag gauges with ``rows``: series absent from ``rows`` are removed,
        so a deleted topic or group does not report its last lag forever."""
        keys: set[tuple[str, str, str]] = set()
        for row in rows:
            key = (row.topic, str(row.partition), row.group)
            keys.add(key)
            self.consumer_lag.labels(*key).set(row.lag)
        for key in self._lag_keys - keys:
            self.consumer_lag.remove(*key)
        self._lag_keys = keys

    def set_engine(self, stage: str, info: Mapping[str, object]) -> None:
        """Publish the engine ``stage`` serves. ``info`` needs the keys of ``ENGINE_FIELDS``
        (``dataclasses.asdict(EngineInfo)`` has them); extra keys are ignored.

        Raises ``KeyError`` naming a missing field.
        """
        missing = [f for f in ENGINE_FIELDS if f not in info]
        if missing:
            raise KeyError(f"engine info lacks {', '.join(missing)}")
        self.engine.labels(stage).info({f: str(info[f]) for f in ENGINE_FIELDS})


def request_modality(modalities: Iterable[str]) -> str:
    """The ``modality`` label of a request: its one modality, or ``mixed``."""
    distinct = set(modalities)
    return next(iter(distinct)) if len(distinct) == 1 else MIXED


def observe_terminal(metrics: Metrics, event: Any, manifest: Any) -> None:
    """Record a request's terminal event (``schemas.events.Event``) where it is sent: its
    assembly span, its end-to-end time and its outcome under the ``assemble`` stage (the
    assembler's, or the router's for a request it answers itself). ``manifest``: the
    request's (``schemas.jobs.Manifest``), or None."""
    modality = request_modality(manifest.modalities) if manifest is not None else "text"
    lane = manifest.lane if manifest is not None else "rt"
    timings = event.timings or {}
    for st in timings.get("stages", []):
        if st["stage"] == "assemble":
            metrics.observe_span("assemble", modality, lane, st["queued_ms"], st["service_ms"])
    if "e2e_ms" in timings:
        metrics.observe_e2e(modality, lane, timings["e2e_ms"])
    if event.error:
        metrics.request_done("assemble", "error", event.error.get("code"))
    else:
        metrics.request_done("assemble", "ok")


class _WorkerCollector(Collector):
    """``mmstream_inflight``, ``mmstream_ready`` and ``mmstream_cold_start_seconds``, read from the worker's
    state at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily("mmstream_inflight", "Items a stage holds between consuming and finishing them.",
                                     labels=("stage",))
        for stage, n in sorted(self.metrics.inflight().items()):
            inflight.add_metric((stage,), n)
        yield inflight
        ready = GaugeMetricFamily("mmstream_ready", "1 while this worker's readiness checks pass (its /readyz), else 0.",
                                  labels=("stage",))
        health = self.metrics.health
        if health.stage is not None:
            ready.add_metric((health.stage,), 1.0 if health.ready() else 0.0)
        yield ready
        cold = GaugeMetricFamily("mmstream_cold_start_seconds", "Seconds from this worker's process start to its stage "
                                 "being ready (phase=ready) and to its first answered item (phase=first_answer).",
                                 labels=("stage", "phase"))
        for phase, seconds in sorted(health.cold_start_s.items()):
            cold.add_metric((health.stage or "", phase), seconds)
        yield cold


def _check(label: str, value: str, allowed: frozenset[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{label}={value!r} is not one of {sorted(allowed)}")
