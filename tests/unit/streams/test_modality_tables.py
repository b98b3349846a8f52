"""Everything the streams layer knows per modality comes from the registry: the built-ins give
exactly the tables that used to be written out by hand, and one registered spec ("memo")
appears in topics, stages, replicas, costs, load, routing, admission, grounding and prompts."""

from __future__ import annotations

import asyncio

from mmstream.supervisor import default_replicas
from schemas import pack, unpack
from schemas.events import Event
from schemas.jobs import EncodeJob, fan_in_from_wire
from schemas.request import Modality, Part
from schemas.settings import Settings, env_name
from streams.policies.assembly import _grounding
from streams.stages import stage_names
from streams.stages.generator import prompt_parts
from streams.stages.routing import Price, Router
from streams.topics import topic_specs
from workers import modalities
from workers import prompt as P

# What the tables said before the registry existed.
OLD_STAGES = ("router", "assembler", "encode.text", "encode.image", "encode.audio", "encode.video", "encode.any",
              "generate", "index", "retrieve", "lagmon")  # (index and retrieve came with collections)
OLD_REPLICAS = {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1, "encode.audio": 1,
                "encode.video": 1, "generate": 1, "index": 1, "retrieve": 1, "lagmon": 1}
OLD_MS_PER_UNIT = {"text": 0.15, "image": 8.0, "video": 8.0, "audio": 300.0}


def make_router(**env: str) -> Router:
    settings = Settings.from_env({env_name(*k.split("__")): v for k, v in env.items()})

    async def exists(topic: str) -> bool:
        return False

    return Router(settings, exists)


def handle(router: Router, obj: dict):
    return asyncio.run(router.handle(pack(obj), [], 1000.0, "test"))


def verdict_event(out) -> Event:
    """The first event of the router's own answer (sent through the assembler)."""
    return Event.from_wire(fan_in_from_wire(unpack(out.value)).events[0])


def encode_topics() -> set[str]:
    return {s.name for s in topic_specs(Settings().kafka) if ".encode." in s.name}


def test_built_ins_give_the_tables_that_were_written_by_hand() -> None:
    assert stage_names() == OLD_STAGES
    assert default_replicas() == OLD_REPLICAS
    assert {s.name: s.ms_per_unit for s in modalities.specs()} == OLD_MS_PER_UNIT
    units = {s.name: s.units for s in modalities.specs()}
    assert (units["text"](400, 16), units["video"](0, 12), units["image"](5000, 16), units["audio"](9, 16)) \
        == (100.0, 12.0, 1.0, 1.0)
    assert encode_topics() == {f"mm.encode.{m}.{lane}" for m in ("text", "image", "audio", "video", "any")
                               for lane in ("rt", "bulk")}


def test_built_in_grounding_and_prompt_parts_are_unchanged() -> None:
    results = [
        {"modality": "text", "extras": {"text": "hi"}},
        {"modality": "image", "extras": {"top5": [["tabby", 0.9]]}},
        {"modality": "audio", "extras": {"transcript": "turn left", "language": "en"}},
        {"modality": "video", "extras": {"frame_top": [[0.0, [["beach", 0.7]]]], "transcript": None}},
        {"modality": "image", "extras": {}, "error": {"code": "unsupported_media"}},
        {"modality": "smell", "extras": {"x": 1}},
    ]
    grounded = [_grounding(r) for r in results]
    assert grounded == [
        {"modality": "text", "text": "hi"},
        {"modality": "image", "labels": [["tabby", 0.9]]},
        {"modality": "audio", "transcript": "turn left"},
        {"modality": "video", "frames": [[0.0, [["beach", 0.7]]]], "transcript": None},
        {"modality": "image", "failed": True},
        {"modality": "smell"},
    ]
    assert prompt_parts(grounded) == [
        P.TextPart("hi"), P.ImagePart([P.Label("tabby", 0.9)]), P.AudioPart("turn left"),
        P.VideoPart([P.FrameLabels(0.0, [P.Label("beach", 0.7)])], None), P.ImagePart([], failed=True),
    ]  # an unknown modality is left out, as before


def test_a_registered_modality_appears_in_every_table(memo) -> None:
    assert stage_names() == (*OLD_STAGES[:6], "encode.memo", *OLD_STAGES[6:])
    assert default_replicas()["encode.memo"] == 2
    assert {"mm.encode.memo.rt", "mm.encode.memo.bulk"} <= encode_topics()
    spec = modalities.get("memo")
    assert spec.ms_per_unit == 0.5 and spec.units(400, 16) == 100.0
    # Before any report, the router prices a part from its spec: 400 bytes = 100 tokens at 0.5 ms.
    assert make_router()._part_stage(Part("memo", data=b"y" * 400)) == Price("encode.memo", 50.0)
    assert _grounding({"modality": "memo", "extras": {"excerpt": "lunch at noon"}}) == \
        {"modality": "memo", "text": "lunch at noon"}
    assert prompt_parts([{"modality": "memo", "text": "lunch at noon"}, {"modality": "memo", "failed": True}]) == \
        [P.AttachmentPart("memo", "text", "lunch at noon"), P.AttachmentPart("memo", "text", "", failed=True)]


def test_the_router_routes_and_admits_a_registered_modality(memo) -> None:
    r = make_router()
    routed = handle(r, {"id": "m1", "parts": [{"modality": "text", "text": "x"},
                                               {"modality": "memo", "data": b"y" * 400}]})
    topics = [o.topic for o in routed.outs]
    assert routed.outcome == "ok" and topics.count("mm.encode.memo.rt") == 1
    job = EncodeJob.from_wire(unpack(next(o.value for o in routed.outs if o.topic == "mm.encode.memo.rt")))
    assert job.modality == "memo" and job.data == b"y" * 400
    # Admission charges the memo pool for the part's own cost, from the spec's units.
    r.load.note_sent("mm.encode.memo.rt", 0, 10_000.0, 0.0)
    refused = handle(r, {"id": "m2", "parts": [{"modality": "memo", "data": b"y"}]})
    assert refused.admission == "reject" and "encode.memo" in verdict_event(refused.outs[0]).error["message"]


def test_an_unregistered_modality_fails_the_whole_request_naming_the_part(memo) -> None:
    routed = handle(make_router(), {"id": "u1", "parts": [{"modality": "text", "text": "x"},
                                                           {"modality": "smell", "data": b"y"}]})
    event = verdict_event(routed.outs[0])
    assert routed.outcome == "error" and event.error["code"] == "unsupported_media"
    assert event.error["field"] == "parts.1.modality"
    assert event.error["message"] == "modality 'smell' is not one of text, image, audio, video, memo"


def test_a_registered_modality_that_is_not_served_fails_that_part_only(memo) -> None:
    routed = handle(make_router(router__served_modalities="text"),
                    {"id": "n1", "parts": [{"modality": "text", "text": "x"}, {"modality": "memo", "data": b"y"}]})
    failed = [f for f in (fan_in_from_wire(unpack(o.value)) for o in routed.outs if o.topic == "mm.encoded.rt")
              if getattr(f, "error", None)]
    assert routed.outcome == "ok" and [(f.part, f.error["code"]) for f in failed] == [(1, "unsupported_media")]


def test_video_is_admitted_against_the_image_pool() -> None:
    r = make_router()
    r.load.note_sent("mm.encode.image.rt", 0, 10_000.0, 0.0)
    refused = handle(r, {"id": "v1", "parts": [{"modality": "video", "data": b"x", "mime": "video/mp4"}]})
    assert refused.admission == "reject" and "encode.image" in verdict_event(refused.outs[0]).error["message"]
    # ... and its soundtrack at the audio pool: bytes of no readable index, at the longest (120 s: 4 windows)
    assert r._part_stage(Part(Modality.VIDEO, data=b"x")) == Price("encode.image", 8.0 * Settings().video.max_frames,
                                                                  0.0, (("encode.audio", 4 * 300.0),))
