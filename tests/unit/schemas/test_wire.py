"""The generic wire codec (schemas/wire.py): the bytes of every message as the hand-written
encoders produced them (written out literally below, key order included), round trips, and
decoding that fails with a ValueError naming the field, whatever the sender put in it."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import DecodeError, pack, unpack
from schemas.errors import ErrorCode
from schemas.events import Event, EventKind
from schemas.jobs import DeadlineTick, EncodedPart, EncodeJob, GenerateJob, Manifest, fan_in_from_wire
from schemas.request import Lane, Limits, Modality, Params, Part, Request, Task, validate_request
from schemas.wire import WireFormatError, from_wire

TENSOR = {"dtype": "float16", "shape": [2], "data": b"\x00<\x00<"}
SPAN = ["route", 1.0, 2.0, 3.5]

# (message, the map the old hand-written to_wire built, in its key order)
GOLDEN: list[tuple[Any, dict[str, Any]]] = [
    (EncodeJob(id="r1", part=0, n_parts=2, modality="text", lane="rt", tenant="t", deadline_at_ms=9.5,
               sent_at_ms=1.25, text="hi", trace=[SPAN]),
     {"v": 1, "type": "encode", "id": "r1", "part": 0, "n_parts": 2, "modality": "text", "lane": "rt",
      "tenant": "t", "deadline_at_ms": 9.5, "sent_at_ms": 1.25, "trace": [SPAN], "text": "hi"}),
    (EncodeJob(id="r1", part=1, n_parts=2, modality="image", lane="bulk", tenant="t", deadline_at_ms=9.5,
               sent_at_ms=1.25, data=b"\x89PNG", ref="redis:k", mime="image/png", chunk=3),
     {"v": 1, "type": "encode", "id": "r1", "part": 1, "n_parts": 2, "modality": "image", "lane": "bulk",
      "tenant": "t", "deadline_at_ms": 9.5, "sent_at_ms": 1.25, "trace": [], "data": b"\x89PNG",
      "ref": "redis:k", "mime": "image/png", "chunk": 3}),
    (Manifest(id="r1", task="embed", tenant="t", lane="rt", reply_to="mm.results", n_parts=2,
              modalities=["text", "image"], deadline_at_ms=9.0, accepted_at_ms=1.0, client_sent_at_ms=0.5,
              sent_at_ms=1.5),
     {"v": 1, "type": "manifest", "id": "r1", "task": "embed", "tenant": "t", "lane": "rt",
      "reply_to": "mm.results", "n_parts": 2, "modalities": ["text", "image"], "deadline_at_ms": 9.0,
      "accepted_at_ms": 1.0, "client_sent_at_ms": 0.5, "sent_at_ms": 1.5, "params": {}, "trace": []}),
    (Manifest(id="r1", task="generate", tenant="t", lane="bulk", reply_to="r", n_parts=1, modalities=["text"],
              deadline_at_ms=9.0, accepted_at_ms=1.0, client_sent_at_ms=0.5, sent_at_ms=1.5,
              params={"max_tokens": 8}, trace=[SPAN], result_key="mm:res:abc"),
     {"v": 1, "type": "manifest", "id": "r1", "task": "generate", "tenant": "t", "lane": "bulk", "reply_to": "r",
      "n_parts": 1, "modalities": ["text"], "deadline_at_ms": 9.0, "accepted_at_ms": 1.0,
      "client_sent_at_ms": 0.5, "sent_at_ms": 1.5, "params": {"max_tokens": 8}, "trace": [SPAN],
      "result_key": "mm:res:abc"}),
    (EncodedPart(id="r1", part=0, modality="text", sent_at_ms=2.0, embedding=TENSOR, cache="miss"),
     {"v": 1, "type": "part", "id": "r1", "part": 0, "modality": "text", "sent_at_ms": 2.0, "embedding": TENSOR,
      "error": None, "extras": {}, "cache": "miss", "trace": []}),
    (EncodedPart(id="r1", part=1, modality="video", sent_at_ms=2.0, extras={"fps": 1.0}, trace=[SPAN], n_chunks=3),
     {"v": 1, "type": "part", "id": "r1", "part": 1, "modality": "video", "sent_at_ms": 2.0, "embedding": None,
      "error": None, "extras": {"fps": 1.0}, "cache": None, "trace": [SPAN], "n_chunks": 3}),
    (EncodedPart(id="r1", part=1, modality="image", sent_at_ms=2.0, error={"code": "internal"}, chunk=2),
     {"v": 1, "type": "part", "id": "r1", "part": 1, "modality": "image", "sent_at_ms": 2.0, "embedding": None,
      "error": {"code": "internal"}, "extras": {}, "cache": None, "trace": [], "chunk": 2}),
    (DeadlineTick("r1"), {"v": 1, "type": "tick", "id": "r1"}),
    (GenerateJob(id="r1", lane="rt", tenant="t", reply_to="mm.results", deadline_at_ms=9.0, accepted_at_ms=1.0,
                 client_sent_at_ms=0.5, sent_at_ms=2.0, parts=[{"modality": "text", "text": "hi"}],
                 params={"max_tokens": 4}, trace=[{"stage": "route", "queued_ms": 1.0, "service_ms": 0.5}]),
     {"v": 1, "type": "generate", "id": "r1", "lane": "rt", "tenant": "t", "reply_to": "mm.results",
      "deadline_at_ms": 9.0, "accepted_at_ms": 1.0, "client_sent_at_ms": 0.5, "sent_at_ms": 2.0,
      "parts": [{"modality": "text", "text": "hi"}], "params": {"max_tokens": 4},
      "trace": [{"stage": "route", "queued_ms": 1.0, "service_ms": 0.5}]}),
    (Event("r1", EventKind.ACCEPTED, 0, 5.5, payload={"task": "embed", "parts": 1}),
     {"v": 1, "id": "r1", "kind": "accepted", "seq": 0, "ts_ms": 5.5, "payload": {"task": "embed", "parts": 1}}),
    (Event("r1", EventKind.RESULT, 1, 6.0, payload={"task": "embed"}, error=None, timings={"e2e_ms": 3.0},
           cache={"hits": 1, "misses": 0}),
     {"v": 1, "id": "r1", "kind": "result", "seq": 1, "ts_ms": 6.0, "payload": {"task": "embed"},
      "timings": {"e2e_ms": 3.0}, "cache": {"hits": 1, "misses": 0}}),
    (Event("r1", EventKind.ERROR, 1, 6.0, error={"code": "internal", "message": "m"}),
     {"v": 1, "id": "r1", "kind": "error", "seq": 1, "ts_ms": 6.0, "error": {"code": "internal", "message": "m"}}),
    (Part(Modality.IMAGE, data=b"\x89PNG", mime="image/png"),
     {"modality": "image", "data": b"\x89PNG", "mime": "image/png"}),
    (Params(max_tokens=8, temperature=0.5, stop=("\n", "END"), stream=False),
     {"max_tokens": 8, "temperature": 0.5, "stop": ["\n", "END"], "stream": False}),
    (Request(id="abc", parts=(Part(Modality.TEXT, text="hi"), Part(Modality.AUDIO, ref="redis:k"))),
     {"v": 1, "id": "abc", "tenant": "default", "task": "embed",
      "parts": [{"modality": "text", "text": "hi"}, {"modality": "audio", "ref": "redis:k"}],
      "params": {"max_tokens": 64, "temperature": 0.0, "stop": [], "stream": True}, "lane": "rt"}),
    (Request(id="abc", parts=(Part(Modality.TEXT, text="hi"),), task=Task.GENERATE, tenant="t",
             params=Params(max_tokens=4), deadline_ms=500, reply_to="mine", lane=Lane.BULK),
     {"v": 1, "id": "abc", "tenant": "t", "task": "generate", "parts": [{"modality": "text", "text": "hi"}],
      "params": {"max_tokens": 4, "temperature": 0.0, "stop": [], "stream": True}, "lane": "bulk",
      "deadline_ms": 500, "reply_to": "mine"}),
]


@pytest.mark.parametrize("message,expected", GOLDEN, ids=lambda x: type(x).__name__)
def test_bytes_are_those_of_the_hand_written_encoders(message, expected):
    assert pack(message.to_wire()) == pack(expected)


@pytest.mark.parametrize("message,expected", [g for g in GOLDEN if hasattr(g[0], "from_wire")],
                         ids=lambda x: type(x).__name__)
def test_the_golden_maps_decode_back(message, expected):
    assert type(message).from_wire(unpack(pack(expected))) == message


# -- round trips (Hypothesis) ---------------------------------------------------------------

text = st.text(max_size=12)
number = st.floats(allow_nan=False, allow_infinity=False)
integer = st.integers(-(2**53), 2**53)
leaf = st.none() | st.booleans() | integer | number | text | st.binary(max_size=8)
anything = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=8)
a_map = st.dictionaries(text, anything, max_size=3)
a_list = st.lists(anything, max_size=3)

encode_jobs = st.builds(EncodeJob, id=text, part=integer, n_parts=integer, modality=text, lane=text, tenant=text,
                        deadline_at_ms=number, sent_at_ms=number, text=st.none() | text,
                        data=st.none() | st.binary(max_size=8), ref=st.none() | text, mime=st.none() | text,
                        trace=a_list, chunk=st.none() | integer)
manifests = st.builds(Manifest, id=text, task=text, tenant=text, lane=text, reply_to=text, n_parts=integer,
                      modalities=st.lists(text, max_size=4), deadline_at_ms=number, accepted_at_ms=number,
                      client_sent_at_ms=number, sent_at_ms=number, params=a_map, trace=a_list,
                      result_key=st.none() | text)
encoded_parts = st.builds(EncodedPart, id=text, part=integer, modality=text, sent_at_ms=number,
                          embedding=st.none() | a_map, error=st.none() | a_map, extras=a_map,
                          cache=st.none() | text, trace=a_list, n_chunks=st.none() | integer,
                          chunk=st.none() | integer)
generate_jobs = st.builds(GenerateJob, id=text, lane=text, tenant=text, reply_to=text, deadline_at_ms=number,
                          accepted_at_ms=number, client_sent_at_ms=number, sent_at_ms=number,
                          parts=st.lists(a_map, max_size=3), params=a_map, trace=a_list)
events = st.builds(Event, id=text, kind=st.sampled_from(EventKind), seq=integer, ts_ms=number,
                   payload=st.none() | a_map, error=st.none() | a_map, timings=st.none() | a_map,
                   cache=st.none() | a_map)
messages = encode_jobs | manifests | encoded_parts | generate_jobs | events | st.builds(DeadlineTick, id=text)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_from_wire_of_to_wire_is_the_message(message):
    assert type(message).from_wire(unpack(pack(message.to_wire()))) == message


@settings(max_examples=100, deadline=None)
@given(st.one_of(manifests, encoded_parts, st.builds(DeadlineTick, id=text)))
def test_fan_in_decodes_each_type(message):
    assert fan_in_from_wire(unpack(pack(message.to_wire()))) == message


ids = st.text("abcXYZ019._:-", min_size=1, max_size=20)
tenants = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,19}", fullmatch=True)
request_parts = st.one_of(
    st.builds(Part, modality=st.just(Modality.TEXT), text=st.text(min_size=1, max_size=20).filter(str.strip),
              mime=st.none() | st.just("text/plain")),
    st.builds(Part, modality=st.sampled_from([Modality.IMAGE, Modality.AUDIO, Modality.VIDEO]),
              data=st.binary(max_size=16), mime=st.none() | st.just("image/png")),
    st.builds(Part, modality=st.sampled_from([Modality.IMAGE, Modality.VIDEO]),
              ref=st.text("abc:", max_size=8).map(lambda s: "redis:" + s)),
)
requests = st.builds(
    # retrieve has rules of its own on parts and params (tests/unit/schemas/test_documents.py)
    Request, id=ids, parts=st.lists(request_parts, min_size=1, max_size=4).map(tuple),
    task=st.sampled_from([t for t in Task if t != Task.RETRIEVE]),
    tenant=tenants, lane=st.sampled_from(Lane), deadline_ms=st.none() | st.integers(1, 600_000),
    reply_to=st.none() | ids.filter(lambda s: ":" not in s),
    params=st.builds(Params, max_tokens=st.integers(1, 1024), temperature=st.floats(0, 2),
                     stop=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple), stream=st.booleans()),
)


@settings(max_examples=200, deadline=None)
@given(requests)
def test_a_request_survives_encoding_and_validation(request):
    wire = unpack(pack(request.to_wire()))
    assert validate_request(wire, Limits()) == request
    assert from_wire(Request, wire) == request  # the structural decode agrees with validation


# -- malformed maps: always a ValueError that names the field ---------------------------------

def _deep(levels: int) -> Any:
    return functools.reduce(lambda inner, _: [inner], range(levels), 1)


JUNK = st.one_of(leaf, st.just({"a": {"b": [1, {"c": 2}]}}), st.just(_deep(2000)), st.just([[]]),
                 st.just({1: 2}), st.just(object()), st.just(float("nan")))


@settings(max_examples=400, deadline=None)
@given(messages, st.data())
def test_any_field_with_any_value_decodes_or_raises_value_error(message, data):
    wire = message.to_wire()
    name = data.draw(st.sampled_from(sorted(wire)))
    wire[name] = data.draw(JUNK)
    try:
        type(message).from_wire(wire)
    except WireFormatError as exc:
        assert exc.field is not None and exc.field.split(".")[0] == name, (exc.field, name)
        assert name in str(exc)


@pytest.mark.parametrize("field,value,message", [
    ("part", {"x": 1}, "part must be an integer, got dict"),
    ("part", True, "part must be an integer, got bool"),
    ("part", "3", "part must be an integer, got str"),
    ("deadline_at_ms", [1.0], "deadline_at_ms must be a number, got list"),
    ("id", 7, "id must be a string, got int"),
    ("data", "text", "data must be bytes, got str"),
    ("trace", {"a": 1}, "trace must be a list, got dict"),
    ("trace", _deep(5000), None),  # deep nesting inside a list[Any] passes through untouched
])
def test_wrong_types_name_the_field(field, value, message):
    wire = GOLDEN[1][1] | {field: value}
    if message is None:
        assert EncodeJob.from_wire(wire).trace[0] is wire["trace"][0]
        return
    with pytest.raises(WireFormatError, match=message) as info:
        EncodeJob.from_wire(wire)
    assert info.value.field == field and isinstance(info.value, ValueError)


def test_missing_required_and_nil_optional_fields():
    wire = dict(GOLDEN[2][1])
    del wire["n_parts"]
    with pytest.raises(WireFormatError, match="n_parts is required") as info:
        Manifest.from_wire(wire)
    assert info.value.field == "n_parts"
    with pytest.raises(WireFormatError, match="must not be nil"):
        Manifest.from_wire(GOLDEN[2][1] | {"id": None})
    # an absent or nil field with a default takes the default; unknown keys are ignored
    m = Manifest.from_wire(GOLDEN[2][1] | {"params": None, "result_key": None, "future": [1, 2]})
    assert m.params == {} and m.result_key is None


def test_version_and_type_are_checked():
    with pytest.raises(WireFormatError, match="expected v 1") as info:
        EncodeJob.from_wire(GOLDEN[0][1] | {"v": 2})
    assert info.value.field == "v"
    with pytest.raises(WireFormatError):
        EncodeJob.from_wire(GOLDEN[0][1] | {"v": True})  # True == 1, but it is no version
    with pytest.raises(WireFormatError, match="expected type 'encode'") as info:
        EncodeJob.from_wire(GOLDEN[2][1])
    assert info.value.field == "type"
    with pytest.raises(WireFormatError, match="expected v 1"):
        Event.from_wire({"v": 9, "id": "a", "kind": "result", "seq": 1, "ts_ms": 1})
    with pytest.raises(WireFormatError, match="expected a map, got list"):
        Event.from_wire([1, 2])


def test_enum_fields_take_only_their_values():
    with pytest.raises(WireFormatError, match="kind must be one of accepted, token, result, error") as info:
        Event.from_wire({"v": 1, "id": "a", "kind": "done", "seq": 1, "ts_ms": 1})
    assert info.value.field == "kind"
    with pytest.raises(WireFormatError):
        Event.from_wire({"v": 1, "id": "a", "kind": {"x": 1}, "seq": 1, "ts_ms": 1})


def test_nested_fields_are_named_with_their_path():
    # Which modalities exist is the registry's business (the router's); the wire only wants a string.
    wire = GOLDEN[-1][1] | {"parts": [{"modality": "text", "text": "hi"}, {"modality": 3}]}
    with pytest.raises(WireFormatError) as info:
        from_wire(Request, wire)
    assert info.value.field == "parts.1.modality"
    wire = GOLDEN[-1][1] | {"params": {"max_tokens": 4, "stop": ["a", 3]}}
    with pytest.raises(WireFormatError) as info:
        from_wire(Request, wire)
    assert info.value.field == "params.stop.1"
    with pytest.raises(WireFormatError) as info:
        GenerateJob.from_wire(GOLDEN[8][1] | {"parts": [{"modality": "text"}, "text"]})
    assert info.value.field == "parts.1"


def test_fan_in_rejects_unknown_or_unreadable_types():
    for bad in ({"v": 1, "type": "mystery"}, {"v": 1, "type": {"a": 1}}, {"v": 1}, [1], None):
        with pytest.raises(WireFormatError, match="unknown fan-in message type"):
            fan_in_from_wire(bad)


def test_deeply_nested_json_is_a_decode_error_not_a_recursion_error():
    with pytest.raises(DecodeError, match="nested too deeply"):
        unpack(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(DecodeError):
        unpack(b"\x81\xa1a" + b"\x91" * 100_000 + b"\x01")  # MessagePack: its own stack limit


def test_error_messages_do_not_echo_long_values():
    with pytest.raises(WireFormatError) as info:
        Event.from_wire({"v": 1, "id": "a", "kind": "x" * 10_000, "seq": 1, "ts_ms": 1})
    assert len(str(info.value)) < 200


def test_codes_stay_plain_strings_on_the_wire():
    wire = Event("a", EventKind.ERROR, 1, 1.0, error={"code": str(ErrorCode.INTERNAL)}).to_wire()
    assert type(wire["kind"]) is str
    assert type(Request(id="a", parts=(Part(Modality.TEXT, text="x"),)).to_wire()["parts"][0]["modality"]) is str
