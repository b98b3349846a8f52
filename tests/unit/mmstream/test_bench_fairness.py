"""The fairness workload's pure parts: both tenants' traffic is a function of the seed, the
abuser's requests pass the router's own validation on the bounds they sit on, and the
report's numbers (ratio, shed counts, memory growth, verdict) come out right."""

from __future__ import annotations

import random
import shutil

import dataclasses

import pytest

from mmstream.bench import BenchConfig
from mmstream.bench.workloads import text_request
from mmstream.bench.abuse import (ABUSE_SHAPES, GENERATE_PROMPT_WORDS, AbuseBounds, AbuseItem, abuse_request,
                                  abuser_plan, ref_blob, victim_schedule)
from mmstream.bench.fairness import (abuser_summary, memory_summary, shed_cause, stage_bounds, text_table, verdict,
                                     victim_comparison)
from mmstream.bench.results import Record, build_run
from schemas.codec import pack, unpack
from schemas.request import Lane, Task, validate_request
from schemas.settings import Settings
from streams.cores.encoder import late_error
from streams.policies.admission import AdmissionLimits, Reject, admit
from streams.policies.quota import QuotaLimits, TenantQuotas
from streams.stages.routing import limits_from

TENANT = "abuser-0123abcd"
BLOB_REF = f"redis:mm:claim:{TENANT}:blob"


def _validated(settings: Settings, item: AbuseItem):
    """The request as the router sees it: packed as the SDK sends it, unpacked, validated."""
    req = abuse_request(item, TENANT, AbuseBounds.from_settings(settings), BLOB_REF)
    wire = pack(req.to_wire())
    return req, len(wire), validate_request(unpack(wire), limits_from(settings))


# -- schedules ----------------------------------------------------------------------------


def test_the_victims_schedule_is_the_seeds_same_arrivals_in_both_phases_with_texts_of_their_own() -> None:
    a_off, a_req = victim_schedule(3, 20.0, 10.0, "alone")
    f_off, f_req = victim_schedule(3, 20.0, 10.0, "flood")
    assert a_off == f_off and len(a_off) > 100
    assert victim_schedule(3, 20.0, 10.0, "alone")[0] == a_off
    assert [p.parts for p in victim_schedule(3, 20.0, 10.0, "alone")[1]] == [p.parts for p in a_req]
    assert [r.parts for r in a_req] != [r.parts for r in f_req]  # the reuse cache cannot answer phase 2
    assert {r.lane for r in a_req + f_req} == {Lane.RT} and {r.task for r in a_req} == {Task.EMBED}
    assert victim_schedule(4, 20.0, 10.0, "alone")[0] != a_off


def test_the_victim_may_send_a_share_of_photos_and_without_one_sends_the_same_texts_as_before() -> None:
    texts = victim_schedule(3, 20.0, 10.0, "alone")[1]
    rng = random.Random("3:20.0:victim:alone")  # what the schedule drew before photos were an option
    assert [r.parts for r in texts] == [text_request(rng, "rt").parts for _ in texts]
    mixed = victim_schedule(3, 20.0, 10.0, "alone", 0.3)[1]
    photos = [r for r in mixed if r.parts[0].modality == "image"]
    assert 0.15 * len(mixed) < len(photos) < 0.45 * len(mixed)
    assert {r.lane for r in mixed} == {Lane.RT} and len({r.parts[0].data for r in photos}) == len(photos)


def test_the_abusers_plan_is_a_function_of_the_seed_and_uses_both_lanes_and_every_shape() -> None:
    plan = abuser_plan(7, 100.0, 5.0, ABUSE_SHAPES)
    assert plan == abuser_plan(7, 100.0, 5.0, ABUSE_SHAPES)
    assert plan != abuser_plan(8, 100.0, 5.0, ABUSE_SHAPES)
    assert 400 < len(plan) < 600
    assert {i.shape for i in plan} == set(ABUSE_SHAPES) and {i.lane for i in plan} == {"rt", "bulk"}
    assert all(0 <= i.offset_s < 5.0 for i in plan) and len({i.tag for i in plan}) == len(plan)
    no_gen = abuser_plan(7, 100.0, 5.0, ("max_text", "ref_fanout"))
    assert {i.shape for i in no_gen} == {"max_text", "ref_fanout"}
    with pytest.raises(ValueError):
        abuser_plan(7, 100.0, 5.0, ("max_video",))


# -- the abuser's requests sit on the bounds, inside validation ---------------------------


@pytest.mark.parametrize("env", [{}, {"MMSTREAM_LIMITS_MAX_PARTS": "4", "MMSTREAM_LIMITS_MAX_TEXT_BYTES": "1000",
                                      "MMSTREAM_LIMITS_MAX_REQUEST_BYTES": "300000"}])
@pytest.mark.parametrize("shape", ["max_text", "max_images", "ref_fanout", "max_generate", "max_audio"])
def test_every_abuse_shape_passes_the_routers_validation_at_its_bounds(shape, env) -> None:
    if shape == "max_audio" and shutil.which("espeak-ng") is None:
        pytest.skip("max_audio's speech needs espeak-ng (apt-get install espeak-ng)")
    settings = Settings.from_env(env)
    b = AbuseBounds.from_settings(settings)
    item = AbuseItem(0.0, shape, "bulk", 0xFEED)
    req, wire_bytes, got = _validated(settings, item)
    assert wire_bytes <= b.max_request_bytes  # else the router parks it in the DLQ, unanswered
    assert got.tenant == TENANT and got.lane == Lane.BULK and got.deadline_ms == b.max_deadline_ms
    assert len(got.parts) <= b.max_parts
    if shape == "max_text":
        assert len(got.parts) == b.max_parts
        assert all(len(p.text.encode()) == b.text_part_bytes <= b.max_text_bytes for p in got.parts)
        assert len({p.text for p in got.parts}) == b.max_parts  # no part answers another from the cache
    if shape == "max_images":
        assert all(len(p.data) <= b.max_inline_bytes and p.mime == "image/png" for p in got.parts)
        assert len({p.data for p in got.parts}) == len(got.parts) >= 1
    if shape == "ref_fanout":
        assert len(got.parts) == b.max_parts and {p.ref for p in got.parts} == {BLOB_REF}
        assert b.blob_bytes <= b.max_ref_bytes and b.max_parts * b.blob_bytes <= b.max_request_ref_bytes
    if shape == "max_generate":
        assert got.task == Task.GENERATE and got.params.max_tokens == b.max_tokens == 1024
    if shape == "max_audio":
        from workers.audio_header import seconds_bound, windows

        assert all(len(p.data) <= b.max_inline_bytes and p.mime == "audio/wav" for p in got.parts)
        assert len({p.data for p in got.parts}) == len(got.parts) >= 1
        if not env:  # 1 MiB of 8 kHz, 8-bit speech: ~131 s, five windows each as the router prices it
            assert [windows(seconds_bound(p.data, len(p.data), 300.0)) for p in got.parts] == [5.0] * len(got.parts)


def test_abuse_shapes_are_the_chosen_ones_or_every_one_the_deployment_serves() -> None:
    from mmstream.bench.abuse import abuse_shapes

    assert abuse_shapes(("max_text", "max_text", "ref_fanout"), True, True) == ("max_text", "ref_fanout")
    assert abuse_shapes((), False, False) == ("max_text", "max_images", "ref_fanout")
    assert "max_generate" in abuse_shapes((), True, False)
    if shutil.which("espeak-ng"):
        assert abuse_shapes((), True, True) == ABUSE_SHAPES
    with pytest.raises(ValueError):
        abuse_shapes(("max_video",), True, True)


def test_the_abusers_content_differs_between_requests() -> None:
    settings = Settings()
    for shape in ("max_text", "max_images", "max_generate") + (("max_audio",) if shutil.which("espeak-ng") else ()):
        one, _, _ = _validated(settings, AbuseItem(0.0, shape, "rt", 1))
        two, _, _ = _validated(settings, AbuseItem(0.0, shape, "rt", 2))
        assert one.parts != two.parts and one.id != two.id


def test_the_images_are_at_the_pixel_bound_and_the_blob_at_its_share_of_the_ref_cap() -> None:
    from workers.image import decode_image

    settings = Settings()
    b = AbuseBounds.from_settings(settings)
    blob = ref_blob(b)
    assert len(blob) == b.blob_bytes == 4 * 1024 * 1024
    req, _, _ = _validated(settings, AbuseItem(0.0, "max_images", "rt", 5))
    for data in (blob, req.parts[0].data):
        image = decode_image(data, "image/png", settings.limits.max_image_pixels, min_shorter_side=256)
        assert image.size[0] * image.size[1] == b.image_side ** 2 <= settings.limits.max_image_pixels
        assert image.size[0] * (image.size[1] + 1) > settings.limits.max_image_pixels  # on the bound, not near it


def test_the_generate_prompt_leaves_room_for_max_tokens_in_the_context() -> None:
    settings = Settings()
    model = settings.models.repository / settings.models.lm_model
    tokenizers = sorted(model.glob("*/tokenizer.json"))
    if not tokenizers:
        pytest.skip("the language model is not built here")
    import json

    from tokenizers import Tokenizer

    from workers import prompt as P

    context = json.loads((tokenizers[-1].parent / "generation.json").read_text())["max_context"]
    req, _, _ = _validated(settings, AbuseItem(0.0, "max_generate", "rt", 9))
    text = P.render_chatml(P.build_messages([P.TextPart(req.parts[0].text)], P.PromptSettings()))
    tokens = len(Tokenizer.from_file(str(tokenizers[-1])).encode(text, add_special_tokens=False).ids)
    assert GENERATE_PROMPT_WORDS <= tokens and tokens + req.params.max_tokens <= context


# -- the report ---------------------------------------------------------------------------


def _run(e2e_ms: list[float], lost: int = 0) -> dict:
    records = [Record("text", ("text",), 0.0, ms, "ok") for ms in e2e_ms]
    records += [Record("text", ("text",), 0.0) for _ in range(lost)]
    return build_run("pipeline", BenchConfig(workload="fairness"), 20.0, records, 10.0, {}, {})


def test_the_victims_ratio_is_flood_over_alone_per_percentile_against_the_bound() -> None:
    alone, flood = _run([10.0] * 99 + [20.0]), _run([12.0] * 99 + [40.0], lost=1)
    v = victim_comparison(alone, flood)
    assert v["alone_ms"]["p99"] == 10.0 and v["flood_ms"]["p99"] == 12.0
    assert v["ratio"] == {"p50": 1.2, "p95": 1.2, "p99": 1.2} and v["p99_within_bound"]
    assert v["lost"] == {"alone": 0, "flood": 1}
    slow = victim_comparison(alone, _run([10.0] * 90 + [16.0] * 10))
    assert slow["ratio"]["p99"] == 1.6 and not slow["p99_within_bound"]
    assert victim_comparison(alone, _run([]))["ratio"]["p99"] is None


def test_the_victims_ratio_is_also_given_per_kind_of_request() -> None:
    def run(text_ms: float, image_ms: float) -> dict:
        records = [Record("text", ("text",), 0.0, text_ms, "ok")] * 50 + [Record("image", ("image",), 0.0, image_ms, "ok")] * 50
        return build_run("pipeline", BenchConfig(workload="fairness"), 20.0, records, 10.0, {}, {})

    v = victim_comparison(run(10.0, 20.0), run(11.0, 60.0))
    assert v["by_modality"]["text"]["ratio"] == 1.1 and v["by_modality"]["image"]["ratio"] == 3.0


def test_shed_causes_are_read_from_the_policies_own_messages() -> None:
    rejected = admit(lane="rt", stages={"encode.text": 5.0}, queued_ms={"encode.text": 900.0}, deadline_ms=30_000,
                     limits=AdmissionLimits(500.0, 2000.0))
    assert isinstance(rejected, Reject) and shed_cause("overloaded", rejected.message) == "admission"
    quotas = TenantQuotas(QuotaLimits(rate_per_s=1.0, max_queued_ms=10.0, ref_bytes_per_s=100.0))
    assert quotas.check("a", lane_limit_ms=500.0, now_ms=0.0) is None
    assert shed_cause("overloaded", quotas.check("a", lane_limit_ms=500.0, now_ms=1.0).message) == "quota_rate"
    quotas.note_sent("b", 50.0, 0.0)
    assert shed_cause("overloaded", quotas.check("b", lane_limit_ms=500.0, now_ms=1.0).message) == "quota_queued"
    assert quotas.check("c", lane_limit_ms=500.0, now_ms=1.0, ref_bytes=10**6) is None  # a full bucket, left in debt
    assert shed_cause("overloaded", quotas.check("c", lane_limit_ms=500.0, now_ms=2.0, ref_bytes=10**6).message) \
        == "quota_ref_bytes"
    compute = TenantQuotas(QuotaLimits(compute_ms_per_s=10.0))
    compute.note_sent("d", 50.0, 0.0)
    assert shed_cause("overloaded", compute.check("d", lane_limit_ms=500.0, now_ms=1.0, cost_ms=5.0).message) \
        == "quota_compute"
    late = late_error("text", 402.0, 400.0, 700).message
    assert shed_cause("overloaded", late) == "encoder_wait"
    assert shed_cause("overloaded", f"every part failed: part 0 (text): overloaded: {late}") == "encoder_wait"
    assert shed_cause("overloaded", "the generator is busy: the first token would come in about 3000 ms") == "generator"
    assert shed_cause("payload_too_large", "refs name too much") == "payload_too_large"


def test_the_abusers_summary_counts_outcomes_causes_and_retry_hints() -> None:
    def rec(outcome, sent=True, retry=None, message="", shape="max_text", lane="rt"):
        r = {"shape": shape, "lane": lane, "outcome": outcome, "message": message, "retry_after_ms": retry}
        if sent:
            r["sent_s"] = 1.0
        return r

    records = ([rec("overloaded", retry=200, message="stage encode.text has 900 ms of work queued")] * 6
               + [rec("overloaded", retry=None, message="tenant a is over its rate of 5 requests per second")]
               + [rec("payload_too_large", shape="ref_fanout", lane="bulk")] + [rec("ok")] * 2
               + [rec(None)] + [rec(None, sent=False)])
    s = abuser_summary(records, duration_s=2.0)
    assert (s["planned"], s["sent"], s["ok"], s["lost"], s["unsent"]) == (12, 11, 2, 1, 1)
    assert s["offered_rate"] == 5.5
    assert s["by_outcome"] == {"overloaded": 7, "payload_too_large": 1, "ok": 2, "lost": 1, "unsent": 1}
    assert s["by_cause"] == {"admission": 6, "quota_rate": 1, "payload_too_large": 1}
    assert s["by_shape"]["ref_fanout"] == {"payload_too_large": 1} and s["by_lane"]["bulk"] == {"payload_too_large": 1}
    assert s["errors_with_retry_after"] == 0.75 and s["overloaded_with_retry_after"] == round(6 / 7, 4)
    assert s["retry_after_ms"]["p50"] == 200
    # Unanswered inside its deadline when the run stopped listening: pending, not lost.
    late = abuser_summary([rec(None), dict(rec(None), sent_s=50.0)], duration_s=2.0, horizon_s=60.0, deadline_s=30.0)
    assert (late["lost"], late["pending"], late["by_outcome"]) == (1, 1, {"lost": 1, "pending": 1})
    # What the pipeline took on is listed by when it was sent: refusals and unsent requests are not.
    assert [(r["sent_s"], r["outcome"]) for r in late["admitted"]] == [(1.0, "lost"), (50.0, "pending")]
    assert [r["outcome"] for r in s["admitted"]] == ["ok", "ok", "lost"]


def test_memory_growth_slope_and_bounds_per_process() -> None:
    samples = [(t * 0.5, "alone" if t < 10 else "flood",
                {"encode.image[0]": 200.0 + (50.0 if t >= 10 else 0.0), "redis": 20.0 + (t if t >= 10 else 0.0)})
               for t in range(30)]
    m = memory_summary(samples, stage_bounds(Settings()))
    img, redis = m["encode.image[0]"], m["redis"]
    assert img["alone"] == {"mean_mb": 200.0, "peak_mb": 200.0} and img["growth_mb"] == 50.0
    assert img["flood_slope_mb_per_s"] == 0.0 and img["bound"] == {"max_queue_jobs": 256}
    assert "within_bound" not in img  # a bound in jobs, not in MiB
    assert redis["flood_slope_mb_per_s"] == 2.0 and redis["bound"] == {"mb": 256} and redis["within_bound"]
    assert redis["series"][0] == [0.0, 20.0] and redis["end_mb"] == 49.0
    v = victim_comparison(_run([10.0] * 100), _run([11.0] * 100))
    a = abuser_summary([{"shape": "max_text", "lane": "rt", "outcome": "overloaded", "message": "", "sent_s": 0.1,
                         "retry_after_ms": 300}], 1.0)
    verdict_ = verdict(v, a, m)
    assert verdict_["victim_p99_within_bound"] and verdict_["abuser_shed_with_retry_after"]
    assert verdict_["memory_within_bounds"] and not verdict_["memory_plateaued"] and not verdict_["all"]


def test_the_text_table_names_both_phases_the_ratio_and_each_process() -> None:
    alone, flood = _run([10.0] * 100), _run([30.0] * 100)
    v = victim_comparison(alone, flood)
    a = abuser_summary([{"shape": "max_text", "lane": "rt", "outcome": "overloaded", "message": "", "sent_s": 0.1,
                         "retry_after_ms": 300}], 1.0)
    m = memory_summary([(0.0, "alone", {"router[0]": 100.0}), (1.0, "flood", {"router[0]": 120.0})],
                       stage_bounds(Settings()))
    doc = {"config": {"rate": 20.0, "duration_s": 10.0}, "abuse_shapes": ["max_text"], "victim": v, "abuser": a,
           "memory": m, "verdict": verdict(v, a, m)}
    text = text_table(doc)
    assert "alone" in text and "flood" in text and "3.00x" in text and "router[0]" in text
    assert "victim_p99_within_bound NO" in text
    slow = Record("text", ("text",), 2000.0, 2090.0, "ok", [{"stage": "route", "queued_ms": 60.4, "service_ms": 3.0}])
    flood["slowest"] = build_run("pipeline", BenchConfig(workload="fairness"), 20.0,
                                 [Record("text", ("text",), 0.0, 30.0, "ok"), slow], 10.0, {}, {})["slowest"]
    assert "  text     2.00:     90 = route 60+3" in text_table({**doc, "phases": {"flood": flood}})


def test_the_fairness_config_runs_at_one_rate_on_the_running_pipeline() -> None:
    cfg = BenchConfig(workload="fairness", rate=20.0, abuse_rate=150.0)
    assert dataclasses.asdict(cfg)["abuse_rate"] == 150.0
    for bad in (dict(mode="monolithic"), dict(rates=(5.0, 10.0)), dict(own_pipeline=True), dict(abuse_rate=0.0)):
        with pytest.raises(ValueError):
            BenchConfig(workload="fairness", **bad)
