"""`mmstream collection put`'s documents from flags and JSON lines, passages and images."""

from __future__ import annotations

import argparse
import json

import pytest

from mmstream.collections_cli import _documents


class UserError(Exception):
    pass


def args(**kw):
    base = {"file": None, "id": None, "text": None, "image": None, "meta": []}
    return argparse.Namespace(**{**base, **kw})


def test_a_passage_and_an_image_from_flags(tmp_path):
    assert _documents(args(id="a", text="hello", meta=["k=v"]), UserError) == [{"id": "a", "text": "hello",
                                                                               "meta": {"k": "v"}}]
    photo = tmp_path / "cat.jpg"
    photo.write_bytes(b"\xff\xd8jpeg")
    [doc] = _documents(args(id="c", image=photo, text="a cat"), UserError)
    assert doc["image"] == b"\xff\xd8jpeg" and doc["mime"] == "image/jpeg" and doc["text"] == "a cat"
    with pytest.raises(UserError):
        _documents(args(id="c", image=tmp_path / "cat.gif"), UserError)


def test_json_lines_take_passages_and_images_beside_the_file(tmp_path):
    (tmp_path / "p.png").write_bytes(b"\x89PNG")
    lines = [{"id": "a", "text": "a passage"}, {"id": "b", "image": "p.png", "meta": {"n": 1}}]
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_text("\n".join(json.dumps(d) for d in lines))
    a, b = _documents(args(file=docs_file), UserError)
    assert a == {"id": "a", "text": "a passage"}
    assert b["image"] == b"\x89PNG" and b["mime"] == "image/png" and b["text"] == "" and b["meta"] == {"n": 1}
    docs_file.write_text(json.dumps({"id": "x", "image": "missing.png"}))
    with pytest.raises(UserError):
        _documents(args(file=docs_file), UserError)
