"""Documents and vector records on the wire, and the retrieval params of a request."""

from __future__ import annotations

import json

import msgpack
import pytest

from schemas.documents import decode_document, doc_id_of, parse_vector_key, vector_key
from schemas.errors import WireError
from schemas.request import Limits, validate_request


def test_a_document_decodes_from_msgpack_or_json_and_every_bound_names_its_field():
    doc = decode_document(msgpack.packb({"v": 1, "text": "hello", "meta": {"a": 1, "b": "x", "c": True}}), 100, 4)
    assert doc.text == "hello" and doc.meta == {"a": 1, "b": "x", "c": True}
    assert decode_document(json.dumps({"text": "hi"}).encode(), 100, 4).meta == {}
    cases = {
        b"\xc1": "value", msgpack.packb([1]): "value", msgpack.packb({"text": ""}): "text",
        msgpack.packb({"text": "x" * 101}): "text", msgpack.packb({"text": "x", "meta": {"k": [1]}}): "meta.k",
        msgpack.packb({"text": "x", "meta": {str(i): i for i in range(5)}}): "meta",
        msgpack.packb({"text": "x", "meta": {"f": float("nan")}}): "meta.f", msgpack.packb({"v": 2, "text": "x"}): "v",
    }
    for raw, field in cases.items():
        with pytest.raises(WireError) as err:
            decode_document(raw, 100, 4)
        assert err.value.field == field, raw


def test_an_image_document_carries_bytes_or_a_claim_check_and_a_known_mime():
    doc = decode_document(msgpack.packb({"image": b"\xff\xd8jpeg", "mime": "image/jpeg", "meta": {"a": 1}}), 100, 4)
    assert doc.modality == "image" and doc.image == b"\xff\xd8jpeg" and doc.text == "" and doc.meta == {"a": 1}
    ref = decode_document(msgpack.packb({"ref": "redis:mm:claim:acme:x", "mime": "image/png", "text": "cap"}), 100, 4)
    assert ref.modality == "image" and ref.ref == "redis:mm:claim:acme:x" and ref.text == "cap"
    assert decode_document(msgpack.packb(doc.to_wire()), 100, 4) == doc
    assert decode_document(msgpack.packb({"text": "plain"}), 100, 4).modality == "text"
    cases = {
        msgpack.packb({"image": b"x", "mime": "video/x-mm-jpeg-frames"}): "mime",  # internal types are not documents
        msgpack.packb({"image": b"x"}): "mime", msgpack.packb({"image": "x", "mime": "image/png"}): "image",
        msgpack.packb({"image": b"x", "ref": "redis:k", "mime": "image/png"}): "ref",
        msgpack.packb({"ref": "file:///etc/passwd", "mime": "image/png"}): "ref",
        msgpack.packb({"image": b"x", "mime": "image/png", "text": "x" * 101}): "text",
        msgpack.packb({"image": b"x" * 2049, "mime": "image/png"}): "image",  # past max_image_bytes
    }
    for raw, field in cases.items():
        with pytest.raises(WireError) as err:
            decode_document(raw, 100, 4, max_image_bytes=2048)
        assert err.value.field == field, raw


def test_document_ids_are_bounded_printable_utf8():
    assert doc_id_of("ünïcode-1".encode()) == "ünïcode-1"
    for bad in (None, b"", b"\xff", b"a\nb", b"x" * 257):
        with pytest.raises(WireError):
            doc_id_of(bad)


def test_a_vector_key_round_trips_and_a_foreign_key_is_not_parsed():
    key = vector_key("acme", "kb", "m/1", "a/b:c")
    assert parse_vector_key(key) == ("acme", "kb", "m/1", "a/b:c")
    for bad in (None, b"", b"acme/kb/doc", msgpack.packb(["a", "b", "c"]), msgpack.packb([1, 2, 3, 4])):
        assert parse_vector_key(bad) is None


def req(task: str, params: dict, parts=None) -> dict:
    return {"id": "r1", "task": task, "parts": parts or [{"modality": "text", "text": "q"}], "params": params}


def test_retrieval_params_go_with_the_tasks_that_search():
    lim = Limits(max_k=10, default_k=4, rag_max_k=3)
    r = validate_request(req("retrieve", {"collection": "kb", "where": {"kind": ["a", "b"], "n": 2}}), lim)
    assert r.params.k == 4 and r.params.where == {"kind": ["a", "b"], "n": 2}
    assert validate_request(req("generate", {"collection": "kb"}), lim).params.k == 3
    assert validate_request(req("embed", {}), lim).params.collection is None
    bad = [
        (req("retrieve", {}), "params.collection"),
        (req("retrieve", {"collection": "kb"}, [{"modality": "text", "text": "a"}] * 2), "parts"),
        (req("retrieve", {"collection": "Bad.Name"}), "params.collection"),
        (req("retrieve", {"collection": "kb", "k": 11}), "params.k"),
        (req("retrieve", {"collection": "kb", "k": True}), "params.k"),
        (req("retrieve", {"collection": "kb", "where": {"a": {"b": 1}}}), "params.where"),
        (req("retrieve", {"collection": "kb", "where": {f"k{i}": 1 for i in range(9)}}), "params.where"),
        (req("embed", {"collection": "kb"}), "params.collection"),
        (req("embed", {"k": 3}), "params.collection"),
        (req("generate", {"collection": "kb", "k": 4}), "params.k"),
    ]
    for obj, field in bad:
        with pytest.raises(WireError) as err:
            validate_request(obj, lim)
        assert err.value.field == field, obj
