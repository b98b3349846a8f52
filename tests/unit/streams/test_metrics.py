"""Metric definitions follow the naming conventions, and each helper produces the samples
an agent expects. Also the pure parts of the lag monitor (offsets to rows to gauges)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import prometheus_client
import pytest
from aiokafka import TopicPartition
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streams.observe.health import WorkerHealth
from streams.observe.lagmon import LagMonitor, LagRow, consumed_topics, lag_rows, pipeline_groups, subscriptions
from streams.observe.http import serve
from streams.observe.metrics import ENGINE_FIELDS, LATENCY_BUCKETS_S, Metrics, request_modality

ALLOWED_LABELS = {"stage", "phase", "modality", "lane", "outcome", "code", "result", "decision", "topic", "partition", "group",
                  "from", "to", "reason", "kind", "task",
                  "tenant"}  # bounded: the first quota.metric_tenants tenants, then `other` (TenantLabels)
ENGINE = {"model": "all-minilm-l6-v2", "version": "1", "precision": "int8",
          "provider": "CPUExecutionProvider", "backend": "onnxruntime"}


def samples(m: Metrics) -> dict[tuple[str, frozenset], float]:
    """Every exposed sample as (name, labels) -> value, parsed back from the text format."""
    text = generate_latest(m.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


# -- naming ---------------------------------------------------------------------------

def test_importing_registers_nothing_globally():
    Metrics()
    assert not [f.name for f in prometheus_client.REGISTRY.collect() if f.name.startswith("mmstream")]


def test_each_metrics_has_its_own_registry_and_a_registry_holds_one():
    a, b = Metrics(), Metrics()
    assert a.registry is not b.registry
    shared = CollectorRegistry()
    Metrics(shared)
    with pytest.raises(ValueError):
        Metrics(shared)


def test_names_units_and_labels_follow_the_conventions():
    m = Metrics()
    families = {f.name: f.type for f in m.registry.collect() if f.name.startswith("mmstream_")}
    assert families == {name: s.type for name, s in m.schema.items()}
    for name, schema in m.schema.items():
        assert re.fullmatch(r"mmstream_[a-z][a-z0-9_]*", name), name
        assert not name.endswith("_total"), "prometheus_client adds _total to counters"
        if schema.type == "histogram" and name != "mmstream_batch_size":
            assert name.endswith("_seconds"), f"{name}: latency in base units"
        own = set(schema.labels) - (set(ENGINE_FIELDS) if schema.type == "info" else set())
        assert own <= ALLOWED_LABELS, f"{name}: {own - ALLOWED_LABELS}"
    m.request_done("route", "ok")
    assert value(m, "mmstream_requests_total", stage="route", outcome="ok") == 1


def test_latency_buckets_cover_half_a_millisecond_to_thirty_seconds():
    assert LATENCY_BUCKETS_S[0] == 0.0005 and LATENCY_BUCKETS_S[-1] == 30.0
    assert list(LATENCY_BUCKETS_S) == sorted(set(LATENCY_BUCKETS_S))


# -- helpers ----------------------------------------------------------------------------

def test_observe_span_records_seconds_per_stage_modality_lane():
    m = Metrics()
    m.observe_span("encode.text", "text", "rt", queued_ms=12.0, service_ms=3.0)
    lab = {"stage": "encode.text", "modality": "text", "lane": "rt"}
    assert value(m, "mmstream_stage_queue_seconds_count", **lab) == 1
    assert value(m, "mmstream_stage_queue_seconds_sum", **lab) == pytest.approx(0.012)
    assert value(m, "mmstream_stage_queue_seconds_bucket", **lab, le="0.01") == 0
    assert value(m, "mmstream_stage_queue_seconds_bucket", **lab, le="0.02") == 1
    assert value(m, "mmstream_stage_service_seconds_sum", **lab) == pytest.approx(0.003)


def test_negative_durations_from_clock_skew_count_as_zero():
    m = Metrics()
    m.observe_span("route", "text", "rt", queued_ms=-5.0, service_ms=1.0)
    assert value(m, "mmstream_stage_queue_seconds_sum", stage="route", modality="text", lane="rt") == 0


def test_observe_batch_uses_power_of_two_buckets():
    m = Metrics()
    m.observe_batch("encode.text", 8)
    assert value(m, "mmstream_batch_size_bucket", stage="encode.text", le="4.0") == 0
    assert value(m, "mmstream_batch_size_bucket", stage="encode.text", le="8.0") == 1
    assert value(m, "mmstream_batch_size_sum", stage="encode.text") == 8


def test_e2e_ttft_tpot():
    m = Metrics()
    m.observe_e2e("mixed", "bulk", 1500.0)
    m.observe_ttft("rt", 80.0)
    m.observe_tpot("rt", 20.0)
    assert value(m, "mmstream_e2e_seconds_sum", modality="mixed", lane="bulk") == pytest.approx(1.5)
    assert value(m, "mmstream_ttft_seconds_sum", lane="rt") == pytest.approx(0.08)
    assert value(m, "mmstream_tpot_seconds_count", lane="rt") == 1


def test_request_done_counts_outcome_and_error_code():
    m = Metrics()
    m.request_done("assemble", "ok")
    m.request_done("assemble", "error", "deadline_exceeded")
    assert value(m, "mmstream_requests_total", stage="assemble", outcome="ok") == 1
    assert value(m, "mmstream_requests_total", stage="assemble", outcome="error") == 1
    assert value(m, "mmstream_errors_total", stage="assemble", code="deadline_exceeded") == 1


@pytest.mark.parametrize("call", [
    lambda m: m.request_done("route", "req-123"),
    lambda m: m.request_done("route", "error", "oops"),
    lambda m: m.cache_lookup("text", "maybe"),
    lambda m: m.admission("rt", "shrug"),
])
def test_values_outside_the_fixed_sets_are_refused(call):
    with pytest.raises(ValueError):
        call(Metrics())


def test_dlq_cache_admission():
    m = Metrics()
    m.to_dlq("route")
    m.cache_lookup("text", "hit")
    m.cache_lookup("text", "miss")
    m.admission("bulk", "reject")
    assert value(m, "mmstream_dlq_total", stage="route") == 1
    assert value(m, "mmstream_requests_total", stage="route", outcome="dlq") == 1
    assert value(m, "mmstream_cache_requests_total", modality="text", result="hit") == 1
    assert value(m, "mmstream_cache_requests_total", modality="text", result="miss") == 1
    assert value(m, "mmstream_admission_decisions_total", lane="bulk", decision="reject") == 1


def test_inflight_and_queue_depth():
    m = Metrics()
    with m.track_inflight("route"):
        assert value(m, "mmstream_inflight", stage="route") == 1
    assert value(m, "mmstream_inflight", stage="route") == 0
    m.set_inflight("encode.text", 7)
    m.set_queue_depth("encode.text", "bulk", 3)
    assert value(m, "mmstream_inflight", stage="encode.text") == 7
    assert value(m, "mmstream_queue_depth", stage="encode.text", lane="bulk") == 3


def test_engine_info():
    m = Metrics()
    m.set_engine("encode.text", {**ENGINE, "extra": "ignored"})
    assert value(m, "mmstream_engine_info", stage="encode.text", **ENGINE) == 1
    with pytest.raises(KeyError, match="provider"):
        m.set_engine("encode.text", {k: v for k, v in ENGINE.items() if k != "provider"})


def test_engine_fallbacks_are_counted_by_stage_variants_and_reason():
    m = Metrics()
    m.engine_fallback("encode.text", "fp16", "fp32", "fidelity")
    m.engine_fallback("encode.text", "fp16", "fp32", "fidelity")
    m.engine_fallback("generate", "TensorrtExecutionProvider", "CUDAExecutionProvider", "provider_failed")
    lab = {"stage": "encode.text", "from": "fp16", "to": "fp32", "reason": "fidelity"}
    assert value(m, "mmstream_engine_fallbacks_total", **lab) == 2
    assert value(m, "mmstream_engine_fallbacks_total", stage="generate", **{
        "from": "TensorrtExecutionProvider", "to": "CUDAExecutionProvider", "reason": "provider_failed"}) == 1
    with pytest.raises(ValueError, match="reason="):
        m.engine_fallback("encode.text", "fp16", "fp32", "tired")


def test_request_modality():
    assert request_modality(["text", "text"]) == "text"
    assert request_modality(["text", "image"]) == "mixed"


def test_serve_on_a_free_port():
    m = Metrics(health=WorkerHealth())
    m.request_done("route", "ok")
    port = serve(0, m.registry, addr="127.0.0.1", health=m.health)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert 'mmstream_requests_total{outcome="ok",stage="route"} 1.0' in resp.read().decode()


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_healthz_and_readyz_follow_the_checks():
    health = WorkerHealth()
    m = Metrics(health=health)
    port = serve(0, m.registry, addr="127.0.0.1", health=health)
    assert get(port, "/healthz")[0] == 200  # alive before anything registers
    assert get(port, "/readyz") == (503, {"ok": False, "stage": None, "checks": {}})  # nothing says ready yet
    state = {"running": False, "crashed": False}
    health.stage = "encode.text"
    health.require("faust:encode.text", ready=lambda: state["running"], live=lambda: not state["crashed"])
    assert get(port, "/readyz")[0] == 503 and value(m, "mmstream_ready", stage="encode.text") == 0
    state["running"] = True
    assert get(port, "/readyz") == (200, {"ok": True, "stage": "encode.text", "checks": {"faust:encode.text": True}})
    assert value(m, "mmstream_ready", stage="encode.text") == 1
    health.require("broken", ready=lambda: 1 / 0)  # a check that raises is a failing check
    assert get(port, "/readyz")[1]["checks"] == {"faust:encode.text": True, "broken": False}
    state["crashed"] = True
    assert get(port, "/healthz") == (503, {"ok": False, "stage": "encode.text", "checks": {"faust:encode.text": False}})


def test_cold_start_phases_count_from_the_process_start_once_each():
    import os
    import time

    from streams.observe.health import process_started_at

    born = process_started_at()
    assert born <= time.time() and born == pytest.approx(process_started_at(os.getpid()))
    health = WorkerHealth()
    health.stage = "encode.text"
    m = Metrics(health=health)
    assert value(m, "mmstream_cold_start_seconds", stage="encode.text", phase="ready") is None
    health.mark("ready")
    ready = value(m, "mmstream_cold_start_seconds", stage="encode.text", phase="ready")
    assert ready == pytest.approx(time.time() - born, abs=1.0)
    m.request_done("encode.text", "error", "invalid_request")  # an error is not an answer
    assert value(m, "mmstream_cold_start_seconds", stage="encode.text", phase="first_answer") is None
    m.request_done("encode.text", "ok")
    first = value(m, "mmstream_cold_start_seconds", stage="encode.text", phase="first_answer")
    assert first is not None and first >= ready
    health.mark("ready")
    m.request_done("encode.text", "ok")  # later ones change nothing
    assert value(m, "mmstream_cold_start_seconds", stage="encode.text", phase="ready") == ready
    assert value(m, "mmstream_cold_start_seconds", stage="encode.text", phase="first_answer") == first


def test_process_metrics_are_on_every_registry():
    names = {f.name for f in Metrics().registry.collect()}
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"} <= names


def test_inflight_adds_what_the_app_counts_to_what_the_stage_sets():
    health = WorkerHealth()
    m = Metrics(health=health)
    health.set_inflight("encode.text", 5)
    m.set_inflight("encode.text", 2)
    assert value(m, "mmstream_inflight", stage="encode.text") == 7



def test_the_app_factory_registers_its_checks():
    from schemas.settings import Settings
    from streams.app import create_app

    health = WorkerHealth()
    create_app(Settings(), "assembler", 0, health)
    assert health.stage == "assembler"
    assert health.readiness() == {"faust:assembler": False}  # not started
    assert health.liveness() == {"faust:assembler": True}


def test_the_lag_monitor_is_ready_while_its_reads_are_recent():
    mon = LagMonitor("127.0.0.1:1", "mm", Metrics(health=WorkerHealth()), interval_s=5.0)
    assert not mon.fresh(now=100.0)
    mon.last_ok_at = 100.0
    assert mon.fresh(now=114.0) and not mon.fresh(now=116.0)


# -- lag: offsets -> rows -> gauges ------------------------------------------------------

T = "mm.encode.text.rt"


def tp(p: int) -> TopicPartition:
    return TopicPartition(T, p)


def test_lag_rows_from_offsets():
    ends = {tp(0): 50, tp(1): 7, tp(2): 100, tp(3): 10, tp(4): 5}
    beginnings = {tp(0): 0, tp(1): 2, tp(2): 60, tp(3): 0, tp(4): 0}
    committed = {tp(0): 20, tp(1): -1, tp(2): 30, tp(3): 12}  # 1: Kafka's "none"; 4: absent
    rows = lag_rows("mm-encode-text", committed, beginnings, ends)
    assert rows == [
        LagRow("mm-encode-text", T, 0, 20, 50, 30),
        LagRow("mm-encode-text", T, 1, None, 7, 5),   # no commit: from the log start
        LagRow("mm-encode-text", T, 2, 30, 100, 40),  # retention passed the commit
        LagRow("mm-encode-text", T, 3, 12, 10, 0),    # a commit past the end is a race, not work
        LagRow("mm-encode-text", T, 4, None, 5, 5),
    ]


def test_only_pipeline_groups_and_topics():
    assert pipeline_groups("mm", ["mm-router", "mmx-router", "mm.router", "other", "mm-encode-text"]) == [
        "mm-encode-text", "mm-router"]
    committed = [TopicPartition("mm.ingress.rt", 0), TopicPartition("mm-assembler-assembly-changelog", 0)]
    subscribed = ["mm.encoded.bulk", "mm-assembler-__assignor-__leader", "mmx.ingress.rt"]
    assert consumed_topics("mm", committed, subscribed) == {"mm.ingress.rt", "mm.encoded.bulk"}


def test_subscriptions_decode_classic_member_metadata_and_skip_the_rest():
    raw = ConsumerProtocolMemberMetadata(0, ["mm.ingress.rt", "mm.ingress.bulk"], b"").encode()
    assert subscriptions([raw, b"\x00garbage"]) == {"mm.ingress.rt", "mm.ingress.bulk"}


def test_consumer_lag_gauges_follow_the_latest_rows():
    m = Metrics()
    m.set_consumer_lag([LagRow("mm-router", "mm.ingress.rt", 0, 5, 9, 4),
                        LagRow("mm-router", "mm.ingress.rt", 1, None, 3, 3)])
    assert value(m, "mmstream_consumer_lag", topic="mm.ingress.rt", partition="1", group="mm-router") == 3
    m.set_consumer_lag([LagRow("mm-router", "mm.ingress.rt", 0, 9, 9, 0)])
    assert value(m, "mmstream_consumer_lag", topic="mm.ingress.rt", partition="0", group="mm-router") == 0
    assert value(m, "mmstream_consumer_lag", topic="mm.ingress.rt", partition="1", group="mm-router") is None


def test_every_reason_a_quota_sheds_for_is_a_known_label():
    from streams.observe.metrics import SHED_REASONS
    from streams.policies.quota import QuotaLimits, TenantQuotas

    q = TenantQuotas(QuotaLimits(rate_per_s=1.0, max_queued_ms=100.0, ref_bytes_per_s=10.0, compute_ms_per_s=10.0))
    seen = set()
    for tenant, kw in (("r", {}), ("b", {"ref_bytes": 100}), ("c", {"cost_ms": 50.0}), ("q", {})):
        q.note_sent(tenant, 1000.0 if tenant == "q" else 0.0, 0.0)
        q.check(tenant, lane_limit_ms=500.0, now_ms=0.0, **kw)  # a full bucket: in (in debt, for bytes)
        q.note_sent(tenant, kw.get("cost_ms", 0.0), 0.0)
        shed = q.check(tenant, lane_limit_ms=500.0, now_ms=0.0, **kw)
        seen.add(shed.reason)
    assert seen == SHED_REASONS == {"rate", "queued", "ref_bytes", "compute"}  # each counts, none raises
