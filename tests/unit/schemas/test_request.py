import base64
import json

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import ErrorCode, Limits, Modality, Part, Request, WireError, pack, unpack
from schemas.codec import DecodeError
from schemas.request import peek_reply, validate_request

LIMITS = Limits(max_text_bytes=100, max_parts=3, max_inline_bytes=10)


def valid(**over):
    m = {"v": 1, "id": "r1", "parts": [{"modality": "text", "text": "hello"}]}
    m.update(over)
    return m


def code_and_field(obj, from_json=False):
    with pytest.raises(WireError) as exc:
        validate_request(obj, LIMITS, from_json=from_json)
    return exc.value.code, exc.value.field


def test_round_trip_through_msgpack():
    req = Request(id="abc", parts=(Part(Modality.TEXT, text="hi"), Part(Modality.IMAGE, data=b"\x89PNG", mime="image/png")))
    back = validate_request(unpack(pack(req.to_wire())), LIMITS)
    assert back == req


def test_json_is_sniffed_and_data_is_base64():
    obj = {"id": "j1", "parts": [{"modality": "image", "data": base64.b64encode(b"abc").decode(), "mime": "image/png"}]}
    raw = json.dumps(obj).encode()
    req = validate_request(unpack(raw), LIMITS, from_json=True)
    assert req.parts[0].data == b"abc"


@pytest.mark.parametrize("obj,code,field", [
    (valid(id=None), ErrorCode.INVALID_REQUEST, "id"),
    (valid(id="has space"), ErrorCode.INVALID_REQUEST, "id"),
    (valid(v=2), ErrorCode.INVALID_REQUEST, "v"),
    (valid(parts=[]), ErrorCode.INVALID_REQUEST, "parts"),
    (valid(parts=[{"modality": "text", "text": "a"}] * 4), ErrorCode.PAYLOAD_TOO_LARGE, "parts"),
    (valid(parts=[{"modality": "smell", "text": "a"}]), ErrorCode.UNSUPPORTED_MEDIA, "parts.0.modality"),
    (valid(parts=[{"modality": "text", "text": "x" * 101}]), ErrorCode.PAYLOAD_TOO_LARGE, "parts.0.text"),
    (valid(parts=[{"modality": "text", "text": "   "}]), ErrorCode.INVALID_REQUEST, "parts.0.text"),
    (valid(parts=[{"modality": "image", "data": b"x" * 11}]), ErrorCode.PAYLOAD_TOO_LARGE, "parts.0.data"),
    (valid(parts=[{"modality": "image", "data": b"x", "ref": "k"}]), ErrorCode.INVALID_REQUEST, "parts.0"),
    (valid(parts=[{"modality": "image", "data": b"x", "mime": "not a mime"}]), ErrorCode.INVALID_REQUEST, "parts.0.mime"),
    (valid(task="dance"), ErrorCode.INVALID_REQUEST, "task"),
    (valid(lane="fast"), ErrorCode.INVALID_REQUEST, "lane"),
    (valid(deadline_ms=0), ErrorCode.INVALID_REQUEST, "deadline_ms"),
    (valid(deadline_ms=10**9), ErrorCode.INVALID_REQUEST, "deadline_ms"),
    (valid(reply_to="bad topic!"), ErrorCode.INVALID_REQUEST, "reply_to"),
    (valid(reply_to="my.replies\n"), ErrorCode.INVALID_REQUEST, "reply_to"),  # `$` would let a newline end it
    (valid(id="r1\n"), ErrorCode.INVALID_REQUEST, "id"),
    (valid(parts=[{"modality": "image", "data": b"x", "mime": "image/png\n"}]), ErrorCode.INVALID_REQUEST,
     "parts.0.mime"),
    (valid(params={"max_tokens": 0}), ErrorCode.INVALID_REQUEST, "params.max_tokens"),
    (valid(params={"temperature": "hot"}), ErrorCode.INVALID_REQUEST, "params.temperature"),
    (valid(params={"stop": [""]}), ErrorCode.INVALID_REQUEST, "params.stop"),
])
def test_each_violation_has_a_stable_code_and_names_the_field(obj, code, field):
    assert code_and_field(obj) == (code, field)


def test_bad_base64_in_json():
    obj = valid(parts=[{"modality": "image", "data": "***"}])
    assert code_and_field(obj, from_json=True) == (ErrorCode.INVALID_REQUEST, "parts.0.data")


def test_error_wire_map_says_whether_to_retry():
    err = WireError(ErrorCode.OVERLOADED, "busy", retry_after_ms=250)
    m = err.to_wire()
    assert m["retriable"] is True and m["retry_after_ms"] == 250 and m["code"] == "overloaded"
    assert WireError(ErrorCode.INVALID_REQUEST, "x").to_wire()["retriable"] is False


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"[1, 2]", b"{not json", msgpack.packb([1, 2])])
def test_undecodable_bytes_raise_decode_error(raw):
    with pytest.raises(DecodeError):
        unpack(raw)


def test_peek_reply_reads_id_of_an_invalid_request():
    assert peek_reply({"id": "r9", "reply_to": "my.replies", "parts": "nonsense"}) == ("r9", "my.replies")
    assert peek_reply({"id": "r9", "reply_to": "bad topic"}) == ("r9", None)
    assert peek_reply({"id": "r9", "reply_to": "my.replies\n"}) == ("r9", None)
    assert peek_reply({"id": 5}) is None
    assert peek_reply([1]) is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.binary(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20))
def test_validation_never_fails_with_anything_but_wire_error(obj):
    try:
        validate_request(obj if isinstance(obj, dict) else {"parts": obj}, LIMITS)
    except WireError:
        pass


def test_a_modality_outside_the_enum_is_accepted_only_when_the_caller_knows_it():
    doc = valid(parts=[{"modality": "doc", "data": b"hi"}])
    assert code_and_field(doc) == (ErrorCode.UNSUPPORTED_MEDIA, "parts.0.modality")  # default: the enum's
    req = validate_request(doc, LIMITS, modalities=("text", "doc"))
    assert req.parts[0].modality == "doc" and req.parts[0].data == b"hi"
    assert req.parts[0].to_wire() == {"modality": "doc", "data": b"hi"}
    text = validate_request(valid(), LIMITS, modalities=("text", "doc")).parts[0]
    assert text.modality is Modality.TEXT  # built-ins stay enum members
    for bad in ("Doc", "doc.x", "d" * 33, 7, None):
        with pytest.raises(WireError) as exc:
            validate_request(valid(parts=[{"modality": bad, "data": b"x"}]), LIMITS, modalities=("doc", "Doc", "doc.x"))
        assert (exc.value.code, exc.value.field) == (ErrorCode.UNSUPPORTED_MEDIA, "parts.0.modality")
    with pytest.raises(WireError, match="not one of text, doc"):
        validate_request(valid(parts=[{"modality": "smell", "data": b"x"}]), LIMITS, modalities=("text", "doc"))
    with pytest.raises(WireError, match="carries `data` or `ref`"):  # only text parts carry text
        validate_request(valid(parts=[{"modality": "doc", "text": "x"}]), LIMITS, modalities=("doc",))
