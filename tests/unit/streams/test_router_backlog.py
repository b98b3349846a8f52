"""The router refuses an rt request that waited past ``router.max_wait_rt_ms`` in its standing
backlog, dated by the broker's append time only (``streams.policies.backlog``): the request is
answered ``overloaded`` with a retry-after before it is priced, and counted as ``late``."""

from __future__ import annotations

import asyncio
import time

from aiokafka.structs import ConsumerRecord

from mmstream.bench.results import shed_cause
from schemas import pack
from schemas.settings import Settings
from schemas.topics import TopicNames
from schemas.trace import now_ms
from streams.app import create_app
from streams.observe.health import WorkerHealth
from streams.observe.metrics import Metrics
from streams.stages.router import LOG_APPEND_TIME, RouterStage
from streams.topics import tenant_topic_specs, topic_specs
from tests.unit.streams.test_router import _with_wait_report, handle, make_router, verdict

NAMES = TopicNames("mm")
CREATE_TIME = 0


def _stage(tmp_path, **env) -> RouterStage:
    settings = Settings.from_env({"MMSTREAM_LOCAL_STATE_DIR": str(tmp_path), **env})
    return RouterStage(create_app(settings, "router", health=WorkerHealth()), settings, Metrics(health=WorkerHealth()))


def _record(appended_ms: float, kind: int = LOG_APPEND_TIME, lane: str = "rt") -> ConsumerRecord:
    return ConsumerRecord(NAMES.ingress(lane), 0, 7, int(appended_ms), kind, None, b"", None, 0, 0, [])


def _stand(stage: RouterStage) -> None:
    """A backlog that has stood (its last good record read over a second ago) on a box past
    its capacity (admission refused a request for want of it just now)."""
    stage.router.backlog.reset(time.monotonic() - 2.0)
    stage.router.backlog.capacity_refused(time.monotonic())


def test_a_late_request_is_refused_overloaded_in_place_of_admission():
    r = make_router()
    raw = pack({"v": 1, "id": "late1", "parts": [{"modality": "text", "text": "x"}]})
    routed = asyncio.run(r.handle(raw, [], 1000.0, "test", late_ms=730.0))
    assert len(routed.outs) == 1  # the answer alone: no manifest, no job
    _, ev = verdict(routed.outs[0])
    assert ev.kind == "error" and ev.error["code"] == "overloaded" and ev.error["retriable"]
    assert ev.error["retry_after_ms"] >= 730 and "waited 730 ms for the router" in ev.error["message"]
    assert shed_cause("overloaded", ev.error["message"]) == "router_wait"  # the bench tells it apart
    # counted apart; a raised router does not step back for its own backlog (it would fall further behind)
    assert routed.admission == "late" and not routed.for_want_of_capacity
    assert asyncio.run(r.handle(raw, [], 1000.0, "test")).outcome == "ok"  # on time: routed as ever


def test_a_late_invalid_request_gets_its_own_error():
    r = make_router()
    routed = asyncio.run(r.handle(pack({"v": 1, "id": "late2", "parts": []}), [], 1000.0, "test", late_ms=900.0))
    assert verdict(routed.outs[0])[1].error["code"] == "invalid_request"


def test_only_the_brokers_append_time_dates_a_record_and_only_on_the_rt_lane(tmp_path):
    stage = _stage(tmp_path)
    _stand(stage)
    old = now_ms() - 5_000.0
    assert stage._late_ms(_record(old)) is not None  # noqa: SLF001 - dated by the broker, waited 5 s
    assert stage._late_ms(_record(old, CREATE_TIME)) is None  # noqa: SLF001 - a client's clock: never
    assert stage._late_ms(_record(old, lane="bulk")) is None  # noqa: SLF001 - bulk waits by design


def test_the_wait_counts_from_the_take_over_and_a_burst_is_routed(tmp_path):
    stage = _stage(tmp_path)
    asyncio.run(stage.on_assigned(set()))  # plaintext, no direct answers: the take-over is the reset
    assert stage.assigned_at_ms > now_ms() - 1_000.0
    assert stage._late_ms(_record(now_ms() - 60_000.0)) is None  # noqa: SLF001 - within the take-over's interval
    _stand(stage)
    stage.assigned_at_ms = now_ms() - 100.0  # what waited for no router counts from the take-over: 100 ms
    assert stage._late_ms(_record(now_ms() - 60_000.0)) is None  # noqa: SLF001
    stage.assigned_at_ms = 0.0
    assert stage._late_ms(_record(now_ms() - 3.0)) is None  # noqa: SLF001 - read at once: the backlog is gone
    assert stage._late_ms(_record(now_ms() - 5_000.0)) is None  # noqa: SLF001


def test_off_and_late_counted(tmp_path):
    stage = _stage(tmp_path, MMSTREAM_ROUTER_MAX_WAIT_RT_MS="0")
    _stand(stage)
    assert stage._late_ms(_record(now_ms() - 5_000.0)) is None  # noqa: SLF001
    r = make_router()
    routed = asyncio.run(r.handle(pack({"v": 1, "id": "late3", "parts": [{"modality": "text", "text": "x"}]}), [],
                                  1000.0, "test", late_ms=800.0))
    stage._observe(routed)  # noqa: SLF001
    assert stage.metrics.registry.get_sample_value("mmstream_admission_decisions_total",
                                                   {"lane": "rt", "decision": "late"}) == 1


def test_ingress_topics_are_dated_by_the_broker_and_no_other():
    s = Settings()
    specs = {t.name: t.config for t in [*topic_specs(s.kafka), *tenant_topic_specs(s.kafka, "acme")]}
    dated = {name for name, c in specs.items() if c.get("message.timestamp.type") == "LogAppendTime"}
    assert dated == {"mm.ingress.rt", "mm.ingress.bulk", NAMES.tenant_ingress("rt", "acme"),
                     NAMES.tenant_ingress("bulk", "acme")}


def test_admissions_capacity_refusal_arms_the_bound_and_a_quota_shed_does_not():
    """The bound holds only on a box past its capacity as admission sees it: a request refused
    because a stage's queue is full arms it; a tenant's quota shed (another tenant's flood)
    does not."""
    raw = pack({"v": 1, "id": "arm1", "parts": [{"modality": "text", "text": "hello there"}]})
    full = _with_wait_report(None, queued=600.0)  # the text pool has 600 ms queued, over rt's 500
    full.backlog.reset(time.monotonic() - 2.0)
    assert not full.backlog.standing(time.monotonic())
    assert verdict(handle(full, raw)[0])[1].error["code"] == "overloaded"
    assert full.backlog.standing(time.monotonic())

    shedding = make_router(quota__rate_per_s="1", quota__burst="1", quota__fair_share="0")
    shedding.backlog.reset(time.monotonic() - 2.0)
    handle(shedding, raw)
    shed = asyncio.run(shedding.handle(pack({"v": 1, "id": "arm2", "parts": [{"modality": "text", "text": "x"}]}),
                                       [], 1000.0, "test"))
    assert shed.shed is not None and not shedding.backlog.standing(time.monotonic())
