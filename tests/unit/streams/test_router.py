import asyncio
import json
from types import SimpleNamespace

from prometheus_client import generate_latest

from schemas import pack, unpack
from schemas.codec import ERROR_HEADER
from schemas.events import Event
from schemas.jobs import EncodeJob, Verdict, fan_in_from_wire
from schemas.settings import Settings, env_name
from streams.observe.metrics import Metrics
from streams.stages.router import RouterStage
from streams.stages.routing import Router


def make_router(**env):
    settings = Settings.from_env({env_name(*k.split("__")): v for k, v in env.items()})

    async def exists(topic):
        return topic == "client.replies"

    return Router(settings, exists)


def handle(router, raw, headers=None):
    return asyncio.run(router.handle(raw, headers or [], 1000.0, "test")).outs


def verdict(out):
    """The router answers a request itself through the assembler: (where the client's events
    go, the first of them)."""
    v = fan_in_from_wire(unpack(out.value))
    assert isinstance(v, Verdict) and out.topic.startswith("mm.encoded.")
    return v.reply_to, Event.from_wire(v.events[0])


def test_valid_request_becomes_a_manifest_and_one_job_per_part():
    r = make_router()
    raw = pack({"v": 1, "id": "a1", "parts": [{"modality": "text", "text": "x"}, {"modality": "text", "text": "y"}]})
    outs = handle(r, raw)
    topics = [o.topic for o in outs]
    # No event for the client from here: the assembler sends `accepted` when the manifest arrives.
    assert topics == ["mm.encoded.rt", "mm.encode.text.rt", "mm.encode.text.rt"]
    assert fan_in_from_wire(unpack(outs[0].value)).n_parts == 2
    jobs = [EncodeJob.from_wire(unpack(o.value)) for o in outs[1:]]
    assert [j.part for j in jobs] == [0, 1] and outs[0].key == b"default/a1"  # <tenant>/<id>


def test_undecodable_bytes_go_to_the_dlq_with_original_headers_and_reason():
    outs = handle(make_router(), b"\xc1\xc1", [("trace-id", b"42")])
    assert len(outs) == 1 and outs[0].topic == "mm.dlq" and outs[0].value == b"\xc1\xc1"
    headers = dict(outs[0].headers)
    assert headers["trace-id"] == b"42" and b"undecodable" in headers[ERROR_HEADER]


def test_schema_violation_with_readable_id_gets_an_error_event():
    outs = handle(make_router(), json.dumps({"id": "b2", "parts": [{"modality": "text", "text": "x" * 70000}]}).encode())
    reply_to, ev = verdict(outs[0])
    assert reply_to == "mm.results" and ev.kind == "error" and ev.error["code"] == "payload_too_large"
    assert ev.error["field"] == "parts.0.text"


def test_schema_violation_without_id_goes_to_dlq():
    outs = handle(make_router(), pack({"parts": []}))
    assert outs[0].topic == "mm.dlq"


def test_unserved_modality_fails_that_part_only():
    r = make_router(router__served_modalities="text,image")
    raw = pack({"v": 1, "id": "c3", "parts": [{"modality": "text", "text": "x"},
                                                {"modality": "audio", "data": b"RIFF", "mime": "audio/wav"}]})
    outs = handle(r, raw)
    fan_in = [fan_in_from_wire(unpack(o.value)) for o in outs if o.topic == "mm.encoded.rt"]
    failed = [m for m in fan_in if getattr(m, "error", None)]
    assert len(failed) == 1 and failed[0].part == 1 and failed[0].error["code"] == "unsupported_media"
    assert [o.topic for o in outs].count("mm.encode.text.rt") == 1


def test_unserved_task_and_unknown_reply_topic_are_errors():
    r = make_router(router__served_tasks="embed")
    outs = handle(r, pack({"id": "d4", "task": "generate", "parts": [{"modality": "text", "text": "x"}]}))
    assert verdict(outs[0])[1].error["field"] == "task"
    outs = handle(r, pack({"id": "d5", "reply_to": "nobody.here", "parts": [{"modality": "text", "text": "x"}]}))
    reply_to, ev = verdict(outs[0])
    assert reply_to == "mm.results" and ev.error["field"] == "reply_to"
    outs = handle(r, pack({"id": "d6", "reply_to": "client.replies", "parts": [{"modality": "text", "text": "x"}]}))
    assert fan_in_from_wire(unpack(outs[0].value)).reply_to == "client.replies"


def test_bulk_lane_and_prefix_follow_settings():
    r = make_router(kafka__topic_prefix="t9")
    outs = handle(r, pack({"id": "e5", "lane": "bulk", "parts": [{"modality": "text", "text": "x"}]}))
    assert [o.topic for o in outs] == ["t9.encoded.bulk", "t9.encode.text.bulk"]


def test_outcome_says_how_the_record_went():
    r = make_router()
    ok = asyncio.run(r.handle(pack({"id": "o1", "parts": [{"modality": "text", "text": "x"}]}), [], None, "t"))
    assert (ok.outcome, ok.modality, ok.lane) == ("ok", "text", "rt")
    bad = asyncio.run(r.handle(pack({"id": "o2", "parts": []}), [], None, "t"))
    assert (bad.outcome, bad.code) == ("error", "invalid_request")
    assert asyncio.run(r.handle(b"\xc1", [], None, "t")).outcome == "dlq"


def test_parts_of_one_request_are_spread_over_partitions():
    from streams.policies.split import spread_partitions

    r = make_router(kafka__partitions="4")
    raw = pack({"id": "s1", "parts": [{"modality": "text", "text": str(i)} for i in range(4)]})
    outs = handle(r, raw)
    assert sorted(o.partition for o in outs if o.topic == "mm.encode.text.rt") == [0, 1, 2, 3]
    assert spread_partitions("x", 6, 4) == [(spread_partitions("x", 1, 4)[0] + i) % 4 for i in range(6)]


def test_generate_text_needs_no_encoder_and_other_parts_do():
    r = make_router()
    outs = handle(r, pack({"id": "g1", "task": "generate", "parts": [
        {"modality": "text", "text": "what is this?"}, {"modality": "image", "data": b"x", "mime": "image/png"}]}))
    fan_in = [fan_in_from_wire(unpack(o.value)) for o in outs if o.topic == "mm.encoded.rt"]
    ready = [m for m in fan_in if getattr(m, "extras", None)]
    assert ready and ready[0].extras == {"text": "what is this?"} and ready[0].error is None
    assert [o.topic for o in outs].count("mm.encode.image.rt") == 1 and "mm.encode.text.rt" not in [o.topic for o in outs]


# -- trust: namespaces, nonces, digests, quotas -----------------------------------------------


def test_every_record_of_a_request_is_keyed_by_tenant_and_carries_one_nonce():
    r = make_router(router__served_modalities="text,image")
    outs = handle(r, pack({"id": "n1", "tenant": "acme", "parts": [
        {"modality": "text", "text": "x"}, {"modality": "audio", "data": b"RIFF", "mime": "audio/wav"}]}))
    fan_in = [(o.key, fan_in_from_wire(unpack(o.value))) for o in outs if o.topic == "mm.encoded.rt"]
    jobs = [EncodeJob.from_wire(unpack(o.value)) for o in outs if o.topic.startswith("mm.encode.")]
    manifest, failed = fan_in[0][1], fan_in[1][1]
    assert {k for k, _ in fan_in} == {b"acme/n1"}
    assert manifest.nonce and len(manifest.nonce) >= 16 and manifest.digest
    assert [j.nonce for j in jobs] == [manifest.nonce] and jobs[0].tenant == "acme"
    assert (failed.tenant, failed.nonce) == ("acme", manifest.nonce)
    again = fan_in_from_wire(unpack(handle(r, pack({"id": "n2", "parts": [{"modality": "text", "text": "x"}]}))[0].value))
    assert again.nonce != manifest.nonce  # fresh per routing


def test_the_digest_names_the_ingress_record():
    r = make_router()
    raw = pack({"id": "dg", "parts": [{"modality": "text", "text": "x"}]})

    def digest(value, ts):
        out = asyncio.run(r.handle(value, [], ts, "t")).outs[0]
        return fan_in_from_wire(unpack(out.value)).digest

    assert digest(raw, 1000.0) == digest(raw, 1000.0)  # a replay, or a producer's retry of the batch
    assert digest(raw, 1000.0) != digest(raw, 1001.0)  # the same request sent again: another record
    assert digest(raw, 1000.0) != digest(pack({"id": "dg", "parts": [{"modality": "text", "text": "y"}]}), 1000.0)
    bad = asyncio.run(r.handle(pack({"id": "dg", "parts": []}), [], 1000.0, "t")).outs[0]
    assert fan_in_from_wire(unpack(bad.value)).digest  # a verdict names its record too


def test_an_invalid_tenant_is_refused_and_answered_under_default():
    outs = handle(make_router(), pack({"id": "t1", "tenant": "a/b", "parts": [{"modality": "text", "text": "x"}]}))
    _, ev = verdict(outs[0])
    assert ev.error["code"] == "invalid_request" and ev.error["field"] == "tenant"
    assert outs[0].key == b"default/t1"


def test_a_tenant_over_its_rate_is_shed_with_retry_after_and_others_are_not():
    r = make_router(quota__rate_per_s="1", quota__burst="2")

    def send(tenant, rid):
        return asyncio.run(r.handle(pack({"id": rid, "tenant": tenant, "parts": [{"modality": "text", "text": "x"}]}),
                                    [], None, "t"))

    assert [send("noisy", f"q{i}").outcome for i in range(2)] == ["ok", "ok"]
    shed = send("noisy", "q3")
    _, ev = verdict(shed.outs[0])
    assert shed.shed == ("noisy", "rate") and ev.error["code"] == "overloaded"
    assert not shed.for_want_of_capacity  # a tenant past its own rate: the engines have room
    assert ev.error["retriable"] and 0 < ev.error["retry_after_ms"] <= 1000
    assert send("quiet", "q4").outcome == "ok"


def test_dead_letters_keep_only_metadata_when_asked():
    outs = handle(make_router(dlq__keep_payload="false"), b"\xc1\xc1secret", [("trace-id", b"42")])
    headers = dict(outs[0].headers)
    assert outs[0].topic == "mm.dlq" and outs[0].value == b""
    assert headers["trace-id"] == b"42" and b"8 bytes dropped" in headers["x-mm-truncated"]


# -- issue 22: refs priced at their stored size, internal media types refused -------------------


def _small_png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48)).save(out, "PNG")
    return out.getvalue()


SMALL_PNG = _small_png()
"""What the fake sizer reads of every ref: a small image's header, priced like a photo's."""


def sized_router(stored: dict[str, int], **env):
    """A router whose claim checks have the sizes ``stored`` (ref -> bytes; others unknown)."""
    from schemas.errors import ErrorCode, WireError
    from workers.claims import ClaimSize

    r = make_router(**env)
    asked = []

    async def sizes(refs, tenant, heads=frozenset()):
        asked.append((list(refs), tenant))
        return {i: ClaimSize(stored[ref], SMALL_PNG) if ref in stored else WireError(ErrorCode.INVALID_REQUEST, "unknown",
                                                                          f"parts.{i}.ref")
                for i, ref in refs}

    r.ref_sizes = sizes
    return r, asked


def image_ref(ref):
    return {"modality": "image", "ref": ref, "mime": "image/jpeg"}


def fan_in(outs):
    return [fan_in_from_wire(unpack(o.value)) for o in outs if o.topic.startswith("mm.encoded.")]


def test_refs_are_sized_at_admission_and_each_job_carries_its_priced_size():
    r, asked = sized_router({"redis:mm:claim:default:a:0": 1234})
    outs = handle(r, pack({"id": "rf1", "parts": [image_ref("redis:mm:claim:default:a:0"),
                                                  image_ref("redis:mm:claim:default:gone:0")]}))
    jobs = [EncodeJob.from_wire(unpack(o.value)) for o in outs if o.topic == "mm.encode.image.rt"]
    assert [(j.part, j.ref_bytes) for j in jobs] == [(0, 1234)]
    failed = [p for p in fan_in(outs) if getattr(p, "error", None)]
    assert [(p.part, p.error["field"]) for p in failed] == [(1, "parts.1.ref")]  # fails alone, at the router
    assert asked[0][1] == "default"


def test_a_ref_over_the_per_ref_limit_fails_its_part_before_any_read():
    r, _ = sized_router({"redis:mm:claim:default:big:0": 5000}, limits__max_ref_bytes="4096")
    outs = handle(r, pack({"id": "rf2", "parts": [image_ref("redis:mm:claim:default:big:0"),
                                                  {"modality": "text", "text": "still answered"}]}))
    assert [o.topic for o in outs].count("mm.encode.image.rt") == 0
    failed = [p for p in fan_in(outs) if getattr(p, "error", None)]
    assert failed[0].error["code"] == "payload_too_large" and "5000" in failed[0].error["message"]


def test_one_blob_named_by_many_parts_counts_many_times_against_the_request_cap():
    ref = "redis:mm:claim:default:blob:0"
    r, _ = sized_router({ref: 1000}, limits__max_request_ref_bytes="15999")
    _, ev = verdict(handle(r, pack({"id": "rf3", "parts": [image_ref(ref)] * 16}))[0])
    assert ev.error["code"] == "payload_too_large" and ev.error["field"] == "parts"
    assert "16000" in ev.error["message"]
    ok = handle(r, pack({"id": "rf4", "parts": [image_ref(ref)] * 15}))
    assert [o.topic for o in ok].count("mm.encode.image.rt") == 15


def test_a_tenants_ref_bytes_are_bucketed_and_shed_with_retry_after():
    ref = "redis:mm:claim:default:blob:0"
    theirs = "redis:mm:claim:other:blob:0"
    r, _ = sized_router({ref: 1000, theirs: 1000}, quota__ref_bytes_per_s="1000", quota__ref_bytes_burst="3000",
                        quota__fair_share="0")
    first = handle(r, pack({"id": "rf5", "parts": [image_ref(ref)] * 3}))
    assert [o.topic for o in first].count("mm.encode.image.rt") == 3
    _, ev = verdict(handle(r, pack({"id": "rf6", "parts": [image_ref(ref)]}))[0])
    assert ev.error["code"] == "overloaded" and ev.error["retriable"] and ev.error["retry_after_ms"] > 0
    assert "bytes per second" in ev.error["message"]
    other = handle(r, pack({"id": "rf7", "tenant": "other", "parts": [image_ref(theirs)]}))
    assert [o.topic for o in other].count("mm.encode.image.rt") == 1  # another tenant's bucket is its own


def test_without_a_sizer_a_ref_is_priced_at_the_most_it_may_read():
    r = make_router(limits__max_ref_bytes="1000", limits__max_request_ref_bytes="2500")
    ok = handle(r, pack({"id": "rf8", "parts": [image_ref("redis:mm:claim:default:a:0")] * 2}))
    jobs = [EncodeJob.from_wire(unpack(o.value)) for o in ok if o.topic == "mm.encode.image.rt"]
    assert [j.ref_bytes for j in jobs] == [1000, 1000]
    _, ev = verdict(handle(r, pack({"id": "rf9", "parts": [image_ref("redis:mm:claim:default:a:0")] * 3}))[0])
    assert ev.error["code"] == "payload_too_large"


def test_internal_media_types_are_refused_from_clients():
    from workers.video import FRAMES_MIME

    for mime in (FRAMES_MIME, FRAMES_MIME.upper(), "image/x-mm-anything", f"{FRAMES_MIME}; q=1"):
        raw = pack({"id": "im1", "parts": [{"modality": "image", "data": b"\x89PNG", "mime": mime}]})
        outs = handle(make_router(), raw)
        assert [o.topic for o in outs] == ["mm.encoded.rt"]  # no job reaches the image pool
        _, ev = verdict(outs[0])
        assert ev.error["code"] in ("unsupported_media", "invalid_request") and ev.error["field"] == "parts.0.mime"


def test_a_records_timestamp_is_believed_only_between_the_max_age_and_now():
    from schemas.trace import now_ms

    r = make_router(router__max_record_age_ms="5000")
    raw = pack({"v": 1, "id": "ts1", "parts": [{"modality": "text", "text": "x"}]})

    def sent_at(ts):
        routed = asyncio.run(r.handle(raw, [], ts, "test"))
        return fan_in_from_wire(unpack(routed.outs[0].value)).client_sent_at_ms, routed.queued_ms

    t = now_ms()
    back, queued = sent_at(t - 86_400_000)  # a day back-dated
    assert t - 5000 - 1 <= back <= t and 4000 <= queued <= 5100
    future, queued = sent_at(t + 86_400_000)  # a day ahead
    assert future <= now_ms() and queued == 0.0
    honest, _ = sent_at(t - 100)
    assert honest == t - 100


def test_one_tenants_garbage_parks_in_the_dlq_only_within_its_budget():
    r = make_router(dlq__tenant_rate_per_s="0.001", dlq__tenant_burst="3")
    routed = [asyncio.run(r.handle(b"\xc1\xc1", [], 1000.0, "test", tenant="flood")) for _ in range(5)]
    assert [x.outcome for x in routed] == ["dlq"] * 3 + ["dlq_dropped"] * 2
    assert routed[-1].outs == []
    other = asyncio.run(r.handle(b"\xc1\xc1", [], 1000.0, "test", tenant="calm"))
    assert other.outcome == "dlq" and len(other.outs) == 1  # another tenant's budget is its own


def test_a_record_whose_routing_raises_is_dead_lettered_and_its_sender_answered_internal(caplog):
    """A bug hit by one record costs that record: it goes to the DLQ, and the client it names
    hears ``internal`` instead of waiting out its timeout; the next record routes as ever."""
    r = make_router()
    price = r._price

    def buggy(req, *args):
        if req.id == "boom":
            raise RuntimeError("x" * 5000)
        return price(req, *args)

    r._price = buggy
    raw = pack({"v": 1, "id": "boom", "reply_to": "client.replies", "parts": [{"modality": "text", "text": "x"}]})
    routed = asyncio.run(r.handle(raw, [], 1000.0, "test"))
    assert routed.outcome == "error" and routed.code == "internal" and routed.key == "default/boom"
    assert [o.topic for o in routed.outs] == ["mm.encoded.rt", "mm.dlq"]
    assert routed.outs[1].value == raw and b"internal" in dict(routed.outs[1].headers)[ERROR_HEADER]
    reply_to, ev = verdict(routed.outs[0])
    assert reply_to == "client.replies" and ev.id == "boom" and ev.kind == "error" and ev.error["code"] == "internal"
    assert max(len(rec.getMessage()) for rec in caplog.records) < 1000  # the exception's text is bounded in the log
    assert handle(r, pack({"v": 1, "id": "fine", "parts": [{"modality": "text", "text": "x"}]}))[0].topic == "mm.encoded.rt"


def test_a_tenant_that_keeps_hitting_a_bug_is_answered_each_time_and_parked_within_its_budget(caplog):
    r = make_router(dlq__tenant_rate_per_s="0.001", dlq__tenant_burst="1")

    def buggy(*args):
        raise RuntimeError("bug")

    r._price = buggy
    raws = [pack({"v": 1, "id": f"b{i}", "parts": [{"modality": "text", "text": "x"}]}) for i in range(3)]
    routed = [asyncio.run(r.handle(raw, [], 1000.0, "test", tenant="t1")) for raw in raws]
    assert [[o.topic for o in x.outs] for x in routed] == [["mm.encoded.rt", "mm.dlq"]] + [["mm.encoded.rt"]] * 2
    assert [verdict(x.outs[0])[1].error["code"] for x in routed] == ["internal"] * 3
    assert sum("router: failed on" in rec.getMessage() for rec in caplog.records) == 1
    assert [x.parked for x in routed] == ["dlq", "dlq_dropped", "dlq_dropped"]
    m = Metrics()
    for x in routed:  # the stage's counters: answered with an error each time, parked once, dropped twice
        RouterStage._observe(SimpleNamespace(metrics=m, raise_=None), x)  # noqa: SLF001
    got = generate_latest(m.registry).decode()
    assert 'mmstream_dlq_total{stage="route"} 1.0' in got
    assert 'mmstream_dlq_dropped_total{stage="route"} 2.0' in got
    assert 'mmstream_requests_total{outcome="error",stage="route"} 3.0' in got


class _SlowResults:
    """A whole-answer store that yields on every lookup, as Redis does."""

    async def get(self, key):
        await asyncio.sleep(0)
        return None


def test_the_records_of_one_poll_are_not_all_admitted_on_the_same_queued_work():
    """A poll's records are routed concurrently; each one's admission and the reservation of
    what it sends happen with no await between, so a burst sees the work the ones before it
    reserved, not the same stale number."""
    settings = Settings.from_env({env_name("admission", "max_queued_ms_rt"): "100"})

    async def exists(topic):
        return False

    r = Router(settings, exists, results=_SlowResults())
    r.models["text"] = "minilm/1/int8"  # published: every request is looked up (an await)
    text = " ".join(f"w{i}" for i in range(400))  # 256 tokens' worth each
    cost = r._part_stage(type("P", (), {"modality": "text", "text": text, "data": None})())[1]  # noqa: SLF001

    async def burst():
        return await asyncio.gather(*(r.handle(pack({"id": f"b{i}", "parts": [{"modality": "text", "text": text}]}),
                                               [], None, "t") for i in range(30)))

    routed = asyncio.run(burst())
    admitted = sum(1 for x in routed if x.outcome == "ok")
    assert 1 <= admitted <= 100 / cost + 1 < 30
    refused = [x for x in routed if x.outcome != "ok"]
    assert refused and all(x.for_want_of_capacity for x in refused)  # what a raised router steps back for
    assert not any(x.for_want_of_capacity for x in routed if x.outcome == "ok")


def test_a_request_over_the_whole_answer_bound_is_not_hashed_or_looked_up():
    asked = []

    class Results:
        async def get(self, key):
            asked.append(key)

    settings = Settings.from_env({env_name("cache", "whole_result_max_bytes"): "1000"})

    async def exists(topic):
        return False

    r = Router(settings, exists, results=Results())
    r.models["text"] = "minilm/1/int8"
    for i, n in enumerate((999, 1001)):
        asyncio.run(r.handle(pack({"id": f"s{i}", "parts": [{"modality": "text", "text": "x" * n}]}), [], None, "t"))
    assert len(asked) == 1


def _flat_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return out.getvalue()


def routed(router, raw):
    return asyncio.run(router.handle(raw, [], 1000.0, "test"))


def test_an_image_is_priced_by_the_pixels_its_header_gives_inline_or_by_ref():
    from workers.claims import ClaimSize

    big = _flat_png(5000, 5000)  # 25 megapixels in a few dozen KB
    r = make_router()
    priced = {j.job.job.part: j.cost_ms for j in routed(r, pack({"id": "px1", "parts": [
        {"modality": "image", "data": big, "mime": "image/png"},
        {"modality": "image", "data": SMALL_PNG, "mime": "image/png"}]})).jobs}
    assert priced[0] > 300.0 and priced[1] < 10.0  # the decode on top of the engine's 8 ms

    async def sizes(refs, tenant, heads=frozenset()):
        return {i: ClaimSize(10_000_000 if "big" in ref else len(SMALL_PNG), big[:2000] if "big" in ref else SMALL_PNG)
                for i, ref in refs}

    r = make_router()  # nothing queued from the first request
    r.ref_sizes = sizes
    by_ref = {j.job.job.part: j.cost_ms for j in routed(r, pack({"id": "px2", "parts": [
        image_ref("redis:mm:claim:default:big:0"), image_ref("redis:mm:claim:default:small:0")]})).jobs}
    assert by_ref[0] > 300.0 + 60.0 and by_ref[1] < 10.0  # the big one's 10 MB are priced too


def test_an_audio_clip_is_priced_by_the_windows_its_duration_bound_allows_inline_or_by_ref():
    """Whisper costs per 30 s window: a 95 s PCM WAV is four windows, a 5 s one is one (its
    header and size say exactly); compressed bytes play at most their size at 6 kbit/s."""
    from tests.unit.workers.test_audio_header import wav
    from workers.claims import ClaimSize

    long, short = wav(95.0, 8_000, 1, 1), wav(5.0, 8_000, 1, 1)  # inline data: under 1 MiB
    r = make_router(router__served_modalities="text,audio")
    priced = {j.job.job.part: j.cost_ms for j in routed(r, pack({"id": "au1", "parts": [
        {"modality": "audio", "data": long, "mime": "audio/wav"},
        {"modality": "audio", "data": short, "mime": "audio/wav"},
        {"modality": "audio", "data": b"ID3" + b"\x00" * 44_997, "mime": "audio/mpeg"}]})).jobs}
    assert priced[0] == 4 * priced[1] and priced[2] == 2 * priced[1]  # 45 KB: at most 60 s

    async def sizes(refs, tenant, heads=frozenset()):
        assert heads == {0}  # its price needs its first bytes
        return {i: ClaimSize(len(long), long[:2000]) for i, ref in refs}

    r = make_router(router__served_modalities="text,audio")
    r.ref_sizes = sizes
    by_ref = [j.cost_ms for j in routed(r, pack({"id": "au2", "parts": [
        {"modality": "audio", "ref": "redis:mm:claim:default:clip:0", "mime": "audio/wav"}]})).jobs]
    assert by_ref == [priced[0]]


def test_a_videos_soundtrack_is_priced_at_the_audio_pool_from_its_index():
    """Its frames load the image pool; its soundtrack the audio pool, per window its MP4 index
    declares: counted in admission there and in the tenant's compute. A silent MP4 costs the
    audio pool nothing; a container it cannot read costs the longest soundtrack."""
    from mmstream.samples import video
    from tests.unit.workers.test_video_header import tone_wav

    r = make_router(router__served_modalities="text,image,audio,video")
    spec = {"modality": "video", "mime": "video/mp4"}
    sound = r._part_stage(type("P", (), {**spec, "text": None, "data": video(["chelsea"], soundtrack=tone_wav(3.0))})())
    silent = r._part_stage(type("P", (), {**spec, "text": None, "data": video(["chelsea"])})())
    unknown = r._part_stage(type("P", (), {**spec, "text": None, "data": b"\x1aE\xdf\xa3" + b"\0" * 4000})())
    assert sound.stage == silent.stage == "encode.image" and sound.ms == silent.ms
    assert sound.also == (("encode.audio", 300.0),) and silent.also == ()  # one window at the audio prior
    assert unknown.also == (("encode.audio", 4 * 300.0),)  # 120 s, the longest video

    quota = make_router(router__served_modalities="text,image,audio,video", quota__compute_ms_per_s="100",
                        quota__compute_burst_ms="1000", admission__max_queued_ms_rt="100000")
    request = {"tenant": "hog", "parts": [{"modality": "video", "data": b"\x1aE\xdf\xa3" + b"\0" * 4000,
                                           "mime": "video/webm"}]}
    outcomes = [routed(quota, pack({**request, "id": f"v{i}"})).outcome for i in range(2)]
    assert outcomes == ["ok", "error"]  # 1.2 s of soundtrack priced over the 1 s bucket: the first in debt
    text = {"id": "t1", "tenant": "hog", "parts": [{"modality": "text", "text": "hi"}]}
    assert routed(quota, pack(text)).outcome == "error"  # the soundtrack was taken from the bucket: in debt

    no_audio = make_router(router__served_modalities="text,image,video")  # nothing fans out to an undeployed pool
    assert no_audio._part_stage(type("P", (), {**spec, "text": None, "data": b"\0" * 100})()).also == ()


def test_a_tenants_compute_quota_sheds_its_costly_requests_and_not_its_neighbours():
    big = _flat_png(5000, 5000)
    r = make_router(quota__compute_ms_per_s="100", quota__compute_burst_ms="1000", admission__max_queued_ms_rt="100000")
    request = {"id": "c1", "tenant": "hog", "parts": [{"modality": "image", "data": big, "mime": "image/png"}]}
    outcomes = [routed(r, pack({**request, "id": f"c{i}"})) for i in range(3)]
    assert [o.outcome for o in outcomes] == ["ok", "ok", "error"]  # ~385 ms each from a 1000 ms bucket
    _, ev = verdict(outcomes[-1].outs[0])
    assert ev.error["code"] == "overloaded" and "engine ms per second" in ev.error["message"]
    assert 1000 < ev.error["retry_after_ms"] < 2000  # ~150 ms short, at 100 ms per second
    small = routed(r, pack({"id": "n1", "tenant": "neighbour", "parts": [{"modality": "text", "text": "hello"}]}))
    assert small.outcome == "ok"


def test_the_compute_quota_is_on_by_default_only_where_tenants_are_authenticated():
    from streams.stages.routing import SECURE_COMPUTE_MS_PER_S, compute_rate

    sasl = {env_name("kafka", "security_protocol"): "SASL_SSL", env_name("kafka", "username"): "svc",
            env_name("kafka", "password"): "secret"}
    assert compute_rate(Settings.from_env({})) == 0.0  # a tenant is only a name there: a limit per name bounds nothing
    assert compute_rate(Settings.from_env(sasl)) == SECURE_COMPUTE_MS_PER_S
    assert compute_rate(Settings.from_env({**sasl, env_name("quota", "compute_ms_per_s"): "0"})) == 0.0
    assert compute_rate(Settings.from_env({env_name("quota", "compute_ms_per_s"): "40"})) == 40.0


def test_without_compute_debt_a_request_over_the_burst_is_payload_too_large():
    big = _flat_png(5000, 5000)
    r = make_router(quota__compute_ms_per_s="100", quota__compute_burst_ms="300", quota__compute_debt="false")
    _, ev = verdict(routed(r, pack({"id": "d1", "parts": [{"modality": "image", "data": big, "mime": "image/png"}]})).outs[0])
    assert ev.error["code"] == "payload_too_large" and ev.error["field"] == "parts" and not ev.error["retriable"]
    assert routed(r, pack({"id": "d2", "parts": [{"modality": "text", "text": "small"}]})).outcome == "ok"


def test_a_generate_request_is_priced_at_the_step_cost_the_generators_report():
    from streams.policies.gen_price import GenCost

    r = make_router(quota__compute_ms_per_s="100", quota__compute_burst_ms="1000", quota__compute_debt="false")
    chat = {"task": "generate", "parts": [{"modality": "text", "text": "hi"}], "params": {"max_tokens": 16}}
    assert routed(r, pack({"id": "g1", **chat})).outcome == "ok"  # ~330 ms at the constant cost
    r.gen_cost = GenCost(fixed_ms=40.0, per_decode_ms=10.0, per_prompt_ms=1.0, threads=2)  # a slower box reported
    _, ev = verdict(routed(r, pack({"id": "g2", **chat})).outs[0])  # 16 x 2 x 50 ms: over the 1000 ms burst
    assert ev.error["code"] == "payload_too_large" and ev.error["field"] == "parts"


def test_a_generation_admitted_in_debt_is_marked_to_run_below_everyone_else():
    from schemas.jobs import Manifest

    r = make_router(quota__compute_ms_per_s="100", quota__compute_burst_ms="1000")
    chat = {"task": "generate", "parts": [{"modality": "text", "text": "hi"}]}

    def manifest(request):
        out = routed(r, pack(request))
        assert out.outcome == "ok"
        m = fan_in_from_wire(unpack(out.outs[0].value))
        assert isinstance(m, Manifest)
        return m

    assert manifest({"id": "b1", "tenant": "t1", **chat, "params": {"max_tokens": 16}}).background is None
    long = manifest({"id": "b2", "tenant": "t2", **chat, "params": {"max_tokens": 256}})  # ~5 s: over the 1 s bucket
    assert long.background is True
    assert Manifest.from_wire(unpack(pack(long.to_wire()))).background is True
    assert long.charged_tokens == 256  # the generator gives back what it does not make of them
    assert long.charged_by == r.replica != make_router().replica  # to this router's buckets, not another's
    plain = make_router()  # no compute quota (plaintext): nothing is in debt, nothing charged
    m = fan_in_from_wire(unpack(routed(plain, pack({"id": "b3", **chat, "params": {"max_tokens": 256}})).outs[0].value))
    assert m.background is None and m.charged_tokens is None and m.charged_by is None


def test_an_embed_request_admitted_in_debt_marks_its_jobs_for_the_pools_to_run_lower():
    from schemas.jobs import Manifest

    r = make_router(quota__compute_ms_per_s="1", quota__compute_burst_ms="1")  # any real request is over it
    texts = [{"modality": "text", "text": "word " * 400} for _ in range(3)]
    out = routed(r, pack({"id": "e1", "tenant": "t1", "parts": texts}))
    assert out.outcome == "ok"
    m = fan_in_from_wire(unpack(out.outs[0].value))
    jobs = [EncodeJob.from_wire(unpack(o.value)) for o in out.outs if o.topic == "mm.encode.text.rt"]
    assert isinstance(m, Manifest) and m.background is True and m.charged_tokens is None
    assert len(jobs) == 3 and all(j.background is True for j in jobs)
    assert EncodeJob.from_wire(unpack(pack(jobs[0].to_wire()))).background is True
    again = routed(r, pack({"id": "e2", "tenant": "t1", "parts": texts}))  # in debt now: refused, not queued
    assert again.outcome != "ok"
    plain = make_router()  # no compute quota: nothing is in debt
    out = routed(plain, pack({"id": "e3", "parts": texts}))
    assert all(EncodeJob.from_wire(unpack(o.value)).background is None for o in out.outs
               if o.topic == "mm.encode.text.rt")


def test_output_tokens_a_generation_did_not_make_go_back_to_its_tenants_bucket():
    from schemas.trace import now_ms

    r = make_router(quota__compute_ms_per_s="100", quota__compute_burst_ms="12000")
    chat = {"task": "generate", "tenant": "t", "parts": [{"modality": "text", "text": "hi"}],
            "params": {"max_tokens": 256}}
    assert [routed(r, pack({"id": f"c{i}", **chat})).outcome for i in range(3)] == ["ok", "ok", "error"]  # ~4.9 s each
    r.give_back({"t": 250}, now_ms())  # the first said six tokens and stopped
    assert routed(r, pack({"id": "c3", **chat})).outcome == "ok"  # back in: 250 tokens' worth returned
    r.give_back({"u": 250}, now_ms())  # a tenant it holds nothing for: nothing made up
    assert "u" not in r.quotas._tenants  # noqa: SLF001


def test_a_part_that_makes_no_job_is_not_priced():
    r, _ = sized_router({}, quota__compute_ms_per_s="100", quota__compute_burst_ms="500", quota__compute_debt="false")
    # An unknown ref fails alone and costs nothing: priced at the bounds it would be ~830 ms.
    ok = routed(r, pack({"id": "nj1", "parts": [image_ref("redis:mm:claim:default:gone:0"),
                                                {"modality": "text", "text": "hello"}]}))
    assert ok.outcome == "ok" and [j.job.job.part for j in ok.jobs] == [1]
    from schemas.request import Part

    priced = r._price(type("R", (), {"task": "generate", "parts": (Part("text", text="a prompt"),)})(), {}, {})
    assert priced == [None]  # a generate request's text goes to the language model, not an encoder


def test_an_images_job_carries_what_its_decode_was_priced_at():
    big = _flat_png(5000, 5000)
    jobs = {j.job.job.part: j.job.job for j in routed(make_router(), pack({"id": "pp1", "parts": [
        {"modality": "image", "data": big, "mime": "image/png"},
        {"modality": "text", "text": "no decode"}]})).jobs}
    assert jobs[0].prep_ms is not None and jobs[0].prep_ms > 300.0  # the encoder prepares it on its heavy thread
    assert jobs[1].prep_ms is None
    assert EncodeJob.from_wire(unpack(pack(jobs[0].to_wire()))).prep_ms == jobs[0].prep_ms


def test_an_image_refs_job_carries_the_pixels_it_was_priced_at():
    from workers.claims import ClaimSize

    r = make_router()

    async def sizes(refs, tenant, heads=frozenset()):
        return {i: ClaimSize(len(SMALL_PNG), SMALL_PNG if i in heads else b"") for i, _ in refs}

    r.ref_sizes = sizes
    outs = handle(r, pack({"id": "rp1", "parts": [image_ref("redis:mm:claim:default:a:0")]}))
    jobs = [EncodeJob.from_wire(unpack(o.value)) for o in outs if o.topic == "mm.encode.image.rt"]
    assert [(j.ref_bytes, j.ref_pixels) for j in jobs] == [(len(SMALL_PNG), 64 * 48)]


def test_a_tenant_past_its_quota_is_refused_before_its_refs_are_sized():
    r, asked = sized_router({"redis:mm:claim:hog:blob:0": 4_000_000}, quota__compute_ms_per_s="10",
                            quota__compute_burst_ms="10", quota__ref_bytes_per_s="1000000000")
    fanout = {"tenant": "hog", "parts": [image_ref("redis:mm:claim:hog:blob:0")] * 16}
    assert routed(r, pack({"id": "f0", **fanout})).outcome == "ok"  # a full bucket: in, and in debt after
    assert len(asked) == 1
    shed = routed(r, pack({"id": "f1", **fanout}))
    assert shed.shed == ("hog", "compute") and len(asked) == 1  # refused unpriced: no Redis round trip
    _, ev = verdict(shed.outs[0])
    assert ev.error["code"] == "overloaded" and ev.error["retry_after_ms"] > 0
    routed(r, pack({"id": "n1", "tenant": "other", "parts": [image_ref("redis:mm:claim:other:x:0")]}))
    assert len(asked) == 2  # another tenant's refs are sized


def test_a_tenant_in_compute_debt_still_gets_an_answer_the_cache_holds_whole():
    class Results:
        async def get(self, key):
            return {"task": "embed", "parts": []} if cached else None

    async def exists(topic):
        return False

    settings = Settings.from_env({env_name("quota", "compute_ms_per_s"): "10", env_name("quota", "compute_burst_ms"): "10"})
    r = Router(settings, exists, results=Results())
    r.models["text"] = "minilm/1/int8"  # published: text requests are looked up
    cached = False
    big = pack({"id": "debt", "tenant": "t", "parts": [{"modality": "image", "data": _flat_png(5000, 5000), "mime": "image/png"}]})
    assert routed(r, big).outcome == "ok"  # admitted on a full bucket, leaving it ~370 ms in debt
    text = {"tenant": "t", "parts": [{"modality": "text", "text": "asked before"}]}
    assert routed(r, pack({"id": "miss", **text})).shed == ("t", "compute")
    cached = True
    hit = routed(r, pack({"id": "hit", **text}))
    assert hit.outcome == "ok" and not hit.jobs  # no engine work: the debt does not stand in its way


def _with_wait_report(scale, queued=200.0, age_ms=0.0, **env):
    """A router whose text encoder reports ``queued`` ms and a ``wait_scale`` (None: none),
    in a report made ``age_ms`` ago."""
    from schemas.trace import now_ms

    r = make_router(**{"admission__max_queued_ms_rt": "500", "admission__max_queued_ms_bulk": "1000", **env})
    stats = {"stage": "encode.text", "at": now_ms() - age_ms, "queued_ms": queued, "queued_rt_ms": queued,
             "partitions": {}, "item_ms": {"16": 1.0, "256": 20.0}}
    if scale is not None:
        stats["wait_scale"] = scale
    r.load.update_reports({"encode.text/a": stats}, now_ms=now_ms())
    return r


def _jobs(outs):
    return [EncodeJob.from_wire(unpack(o.value)) for o in outs if o.topic.startswith("mm.encode.text.")]


def test_admission_holds_the_calibrated_wait_to_its_bound_and_each_job_carries_the_wait_as_predicted():
    """An encoder that reports its rt jobs wait 3x what the router predicted for them makes
    the router count that: a queue of 200 ms predicted is 700 ms to a request (over rt's 500).
    At 1.5x it is 325 ms: admitted, and the job carries the prediction before the correction
    (what the encoder learns against). The report is as old as the test took to get from
    making it to routing (a few ms), and counts as worked down by that much."""
    raw = pack({"v": 1, "id": "w1", "parts": [{"modality": "text", "text": "hello there"}]})
    for scale in (None, 1.5):
        jobs = _jobs(handle(_with_wait_report(scale), raw))
        assert len(jobs) == 1 and 150.0 < jobs[0].predicted_wait_ms <= 200.0, scale
        carried = jobs[0].predicted_wait_ms
        assert EncodeJob.from_wire(unpack(pack(jobs[0].to_wire()))).predicted_wait_ms == carried

    outs = handle(_with_wait_report(3.0), raw)
    reply_to, ev = verdict(outs[0])
    assert ev.kind == "error" and ev.error["code"] == "overloaded" and ev.error["retry_after_ms"] > 0


def test_a_report_read_late_counts_as_worked_down_since_so_a_batch_done_meanwhile_refuses_no_one():
    """Reports are up to two refreshes old when admission reads them. 600 ms queued (over rt's
    500) in a report made 400 ms ago is 200 ms now: a request sent right after its predecessor's
    answer is admitted, not refused behind the batch that answered it. Just made, it is refused."""
    raw = pack({"v": 1, "id": "d1", "parts": [{"modality": "text", "text": "hello there"}]})
    jobs = _jobs(handle(_with_wait_report(None, queued=600.0, age_ms=400.0), raw))
    assert len(jobs) == 1 and jobs[0].predicted_wait_ms <= 200.0
    _, ev = verdict(handle(_with_wait_report(None, queued=600.0), raw)[0])
    assert ev.kind == "error" and ev.error["code"] == "overloaded"


def test_the_wait_correction_applies_to_rt_on_a_stage_the_model_sees_busy():
    """rt jobs teach the scale, so bulk is admitted on the model's own prediction; and a stage
    the model sees as idle stays idle (a request costlier than the whole limit still gets on it)."""
    bulk = pack({"v": 1, "id": "b1", "lane": "bulk", "parts": [{"modality": "text", "text": "hello there"}]})
    assert len(_jobs(handle(_with_wait_report(4.0, queued=600.0), bulk))) == 1  # 600 of bulk's 1000
    costly = pack({"v": 1, "id": "c1", "parts": [{"modality": "text", "text": " ".join(f"w{i}" for i in range(400))}]})
    assert len(_jobs(handle(_with_wait_report(4.0, queued=0.3, admission__max_queued_ms_rt="10"), costly))) == 1


def test_each_part_of_a_request_is_predicted_to_wait_behind_the_parts_before_it_on_its_topic():
    parts = [{"modality": "text", "text": t} for t in ("one", "two words", "three words here")]
    jobs = _jobs(handle(_with_wait_report(None), pack({"v": 1, "id": "m1", "parts": parts})))
    waits = [j.predicted_wait_ms for j in sorted(jobs, key=lambda j: j.part)]
    assert 150.0 < waits[0] <= 200.0 and waits[0] < waits[1] < waits[2]  # the report worked down a few ms


class _Joint:
    """What ``RouterStage._hand_over`` asks of a joint, recorded."""

    def __init__(self):
        self.sent, self.sealed, self.unexpected = [], False, 0

    def expect(self):
        return lambda out: None

    def unexpect(self):
        self.unexpected += 1

    def send(self, outs):
        self.sent.extend(outs)

    def seal(self):
        self.sealed = True


class _BrokenEncoder:
    name, modality = "encode.text", "text"

    def take(self, offers, max_queued_ms, max_part_ms):
        raise RuntimeError("a bug in the hand-over")


def test_a_hand_over_that_raises_sends_the_jobs_through_their_topic_and_logs_once_per_thousand(caplog):
    topic = "mm.encode.text.rt"
    stage = SimpleNamespace(colocated={topic: _BrokenEncoder()}, settings=Settings(), handover_failures=0)
    for _ in range(3):  # three polls, each hitting the bug
        joint, out = _Joint(), object()
        job = SimpleNamespace(job=SimpleNamespace(topic=topic, job=None), out=out, cost_ms=1.0)
        RouterStage._hand_over(stage, [(joint, [job])])  # noqa: SLF001
        assert joint.sent == [out] and joint.unexpected == 1 and joint.sealed  # the job goes the pool's way
    assert stage.handover_failures == 3
    assert sum("handing 1 jobs" in rec.getMessage() for rec in caplog.records) == 1
