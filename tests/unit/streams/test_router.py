import asyncio
import json

from schemas import pack, unpack
from schemas.codec import ERROR_HEADER
from schemas.events import Event
from schemas.jobs import EncodeJob, Verdict, fan_in_from_wire
from schemas.settings import Settings, env_name
from streams.stages.router import Router


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
    assert [j.part for j in jobs] == [0, 1] and outs[0].key == b"a1"


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
    from streams.split import spread_partitions

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
