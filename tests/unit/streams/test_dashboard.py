"""The Grafana dashboard and the alerting rules ask only for metrics and labels that
``streams.observe.metrics.Metrics`` defines, so renaming one in code without the other fails here.

A small PromQL scanner (enough for the queries we write, not a parser) finds, per
expression: the series selected, the labels in ``{...}`` matchers next to each series, and
the labels of ``by``/``without``/``on``/``ignoring`` clauses. Series names are checked
against the names Prometheus actually sees, derived from each family's type the way
prometheus_client exposes it (and cross-checked against its real output below).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streams.observe.health import WorkerHealth
from streams.observe.lagmon import LagRow
from streams.observe.metrics import Metrics, MetricSchema

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "infra" / "grafana" / "mmstream.json"
ALERTS = REPO / "infra" / "prometheus" / "alerts.yml"

# Added by Prometheus to every scraped series.
TARGET_LABELS = {"job", "instance"}
# Series that are not ours: Prometheus' per-target ``up`` and the process collector on
# every registry (checked against its real output below).
FOREIGN_SERIES = {"up": set(), "process_cpu_seconds_total": set(), "process_resident_memory_bytes": set(),
                  "process_virtual_memory_bytes": set(), "process_open_fds": set(), "process_max_fds": set(),
                  "process_start_time_seconds": set()}
OPERATOR_WORDS = {"and", "or", "unless", "bool", "offset"}
FUNCTIONS = {"sum", "avg", "min", "max", "count", "topk", "bottomk", "rate", "irate", "increase", "deriv",
             "histogram_quantile", "clamp_min", "clamp_max", "abs", "max_over_time", "avg_over_time", "label_replace",
             "absent", "vector"}
GROUPING = r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def exposed_series(schema: dict[str, MetricSchema]) -> dict[str, set[str]]:
    """Series name -> its labels, for every series each family exposes:
    histogram: ``_bucket`` (plus ``le``), ``_sum``, ``_count``; counter: ``_total``;
    gauge: the name itself; info: ``_info``. (``_created`` series are not queried.)"""
    out: dict[str, set[str]] = {}
    for name, s in schema.items():
        labels = set(s.labels)
        if s.type == "histogram":
            out[f"{name}_bucket"] = labels | {"le"}
            out[f"{name}_sum"] = labels
            out[f"{name}_count"] = labels
        elif s.type == "counter":
            out[f"{name}_total"] = labels
        elif s.type == "info":
            out[f"{name}_info"] = labels
        else:
            out[name] = labels
    return out


def scan(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(series name -> labels matched on it, labels of grouping clauses) of one expression.
    Raises AssertionError on an identifier that is neither a function, a keyword nor a series.
    Labels that ``label_replace`` creates are left out of the grouping labels."""
    made = set(re.findall(r'label_replace\([^,]+,\s*"(\w+)"', expr))
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings may hold anything
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors, incl. $__rate_interval
    selected: dict[str, set[str]] = {}
    for m in re.finditer(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        selected.setdefault(m.group(1), set()).update(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(2)))
    expr = re.sub(r"\{[^}]*\}", "", expr)
    grouping = {label.strip() for m in re.finditer(GROUPING, expr) for label in m.group(2).split(",")
                if label.strip()} - made
    expr = re.sub(GROUPING, "", expr)
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call:
            assert word in FUNCTIONS, f"unknown function {word!r}"
        elif word not in OPERATOR_WORDS:
            selected.setdefault(word, set())
    return selected, grouping


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend format) of every dashboard target."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dash["panels"] for t in p["targets"]]


RULES = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def recorded_series() -> dict[str, set[str]]:
    """Series the recording rules make: their labels are the rule's grouping labels (plus
    those ``label_replace`` makes) and the rule's own ``labels``."""
    out: dict[str, set[str]] = {}
    for r in (r for r in RULES if "record" in r):
        grouping = {label.strip() for m in re.finditer(GROUPING, r["expr"]) for label in m.group(2).split(",")}
        out.setdefault(r["record"], set()).update({g for g in grouping if g} | set(r.get("labels", {})))
    return out


SERIES = {**exposed_series(Metrics().schema), **FOREIGN_SERIES, **recorded_series()}


def alert_queries() -> list[tuple[str, str, str]]:
    """Every rule that reads series (the KEDA limits are constants: test_k8s.py checks them)."""
    return [(r.get("alert") or r["record"], r["expr"], r.get("annotations", {}).get("summary", ""))
            for r in RULES if not r["expr"].startswith("vector(")]


QUERIES = dashboard_queries() + alert_queries()


@pytest.mark.parametrize("title,expr,legend", QUERIES, ids=[q[0] for q in QUERIES])
def test_every_series_and_label_in_a_query_exists(title: str, expr: str, legend: str) -> None:
    selected, grouping = scan(expr)
    assert selected, f"{title}: no series in {expr!r}"
    for series, matched in selected.items():
        assert series in SERIES, f"{title}: {series!r} is not a series of streams.observe.metrics.Metrics"
        known = SERIES[series] | TARGET_LABELS
        assert matched <= known, f"{title}: {series} has no label(s) {matched - known}"
        assert grouping <= known, f"{title}: {series} has no label(s) {grouping - known}"
    # A legend or summary can only name labels the query's result still carries.
    used = set(re.findall(r"\{\{\s*\$?(?:labels\.)?(\w+)\s*\}\}", legend)) | set(re.findall(r"\$labels\.(\w+)", legend))
    kept = grouping if grouping else set.union(*(SERIES[s] for s in selected)) | TARGET_LABELS
    assert used <= kept, f"{title}: legend uses {used - kept}, the result has {kept}"


def test_the_scanner_catches_drift() -> None:
    selected, _ = scan("sum by (stage) (rate(mmstream_request_totl[5m]))")
    assert set(selected) == {"mmstream_request_totl"} and "mmstream_request_totl" not in SERIES
    with pytest.raises(AssertionError, match="unknown function"):
        scan("sum by (stage) (rat(mmstream_requests_total[5m]))")
    selected, grouping = scan('sum by (le, lane) (rate(mmstream_e2e_seconds_bucket{lane="rt"}[$__rate_interval]))')
    assert selected == {"mmstream_e2e_seconds_bucket": {"lane"}} and grouping == {"le", "lane"}
    assert "mmstream_e2e_seconds" not in SERIES and "mmstream_requests" not in SERIES
    assert "mmstream_consumer_lag_total" not in SERIES and "mmstream_engine_info" in SERIES


def test_suffix_rules_match_what_prometheus_client_exposes() -> None:
    m = Metrics(health=WorkerHealth())
    m.observe_span("route", "text", "rt", 1.0, 1.0)
    m.observe_batch("encode.text", 2)
    m.observe_e2e("text", "rt", 1.0)
    m.observe_ttft("rt", 1.0)
    m.observe_tpot("rt", 1.0)
    m.request_done("route", "error", "internal")
    m.to_dlq("route")
    m.dlq_dropped("route")
    m.engine_fallback("encode.text", "fp16", "fp32", "fidelity")
    m.cache_lookup("text", "hit")
    m.admission("rt", "admit")
    m.tenant_shed("acme", "rate")
    m.tenant_paced("acme", 0.5, True, "refused")
    m.set_consumer_lag([LagRow("mm-router", "mm.ingress.rt", 0, 1, 2, 1)])
    m.set_inflight("route", 1)
    m.set_queue_depth("route", "rt", 1)
    m.set_state("assemble", open=1)
    m.task_restart("assemble", "sweep")
    m.set_cpu_nice("route", -10)
    m.set_cpu_nice("encode.text", 10, lowered=True)
    m.set_engine("encode.text", {"model": "m", "version": "1", "precision": "fp32", "provider": "cpu",
                                 "backend": "onnxruntime"})
    m.health.stage = "route"
    m.health.mark("ready")
    exposed: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                exposed.setdefault(s.name, set()).update(s.labels)
    assert exposed == {k: v for k, v in SERIES.items() if k != "up" and k not in recorded_series()}


def test_dashboard_uses_the_datasource_variable_everywhere() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert any(v["name"] == "DS_PROMETHEUS" and v["type"] == "datasource" for v in dash["templating"]["list"])
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]), p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_has_template_variables_and_uses_only_defined_ones() -> None:
    dash = json.loads(DASHBOARD.read_text())
    defined = {v["name"] for v in dash["templating"]["list"]}
    assert {"group", "stage", "lane"} <= defined
    for title, expr, _ in dashboard_queries():
        used = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval", "__interval"}
        assert used <= defined, f"{title}: undefined variable(s) {used - defined}"
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            selected, _ = scan(v["definition"].removeprefix("label_values(").rsplit(",", 1)[0])
            assert set(selected) <= set(SERIES), v["name"]


def test_current_lag_per_stage_and_lane_and_worker_health_are_at_the_top() -> None:
    dash = json.loads(DASHBOARD.read_text())
    top = [p for p in dash["panels"] if p["gridPos"]["y"] == 0]
    lag_now = next(p for p in top if "Lag now" in p["title"])
    target = lag_now["targets"][0]
    assert target.get("instant") and "mmstream:consumer_lag:by_group_lane" in target["expr"]
    assert any("up{" in t["expr"] and any("mmstream_ready" in u["expr"] for u in p["targets"])
               for p in top for t in p["targets"])
    assert any('mmstream_ready{stage="lagmon"}' in t["expr"] for p in top for t in p["targets"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for needed in ("histogram_quantile(0.99", "mmstream_cache_requests_total", "mmstream_admission_decisions_total",
                   "process_cpu_seconds_total", "mmstream_inflight", "rate("):
        assert needed in exprs, needed
