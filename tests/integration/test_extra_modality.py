"""A modality registered from outside the package goes end to end through the real pipeline:
the "doc" plugin of docs/adding-a-modality.md (its code block as it stands, written out by
tests/integration/doc_modality.py), loaded into every worker by
``MMSTREAM_MODALITIES_PLUGINS``, gets its own topics and encode stage, is embedded with the
real text model, answers per part, and grounds a real generation."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from schemas.request import Modality, Params, Part, Request, Task
from schemas.tensor import from_wire
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline
from tests.integration.doc_modality import write_plugin
from workers import modalities

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def doc_pipeline(infra, tmp_path_factory):
    before = dict(modalities.REGISTRY)
    root = tmp_path_factory.mktemp("plugin")
    plugin = write_plugin(root)  # mypkg.doc, from the guide
    # The supervisor loads the plugin into this process too (to know the encode.doc stage).
    sys.path.insert(0, str(root))
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    try:
        pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.doc": 1, "generate": 1},
                              MMSTREAM_MODALITIES_PLUGINS=plugin, MMSTREAM_ROUTER_SERVED_MODALITIES="text,doc",
                              PYTHONPATH=path)
        yield pipe
        pipe.supervisor.stop()
    finally:
        # Leave the registry as other tests in this process expect it (and let a later load re-register).
        modalities.REGISTRY.clear()
        modalities.REGISTRY.update(before)
        for name in (plugin, f"{plugin}_runner", plugin.split(".")[0]):
            sys.modules.pop(name, None)
        sys.path.remove(str(root))


def _vec(part) -> np.ndarray:
    return from_wire(part["embedding"]).astype(np.float32)


async def test_a_doc_part_is_embedded_by_its_own_stage_like_the_same_text(doc_pipeline):
    sentence = "A cat sleeps on a sunny windowsill."
    async with Client(doc_pipeline.bootstrap, doc_pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), deadline_ms=120_000, parts=(
            Part(Modality.TEXT, text=sentence), Part("doc", data=f"  {sentence}\n".encode(), mime="text/plain"),
            Part("doc", data="Interest rates rose again this quarter.".encode()))))
        event = await sub.result(timeout_s=150)
    assert event.kind == "result" and not event.payload["partial"], event
    text, doc, other = event.payload["parts"]
    assert doc["modality"] == "doc" and doc["extras"] == {"chars": len(sentence), "excerpt": sentence}
    assert float(_vec(text) @ _vec(doc)) > 0.999  # the same words, the same model, the same vector
    assert float(_vec(doc) @ _vec(other)) < 0.5
    doc_parts = [p for p in event.timings["parts"] if p["modality"] == "doc"]
    assert {s[0] for p in doc_parts for s in p["spans"]} == {"encode.doc"}


async def test_a_broken_doc_fails_alone_and_an_unknown_modality_fails_the_request(doc_pipeline):
    async with Client(doc_pipeline.bootstrap, doc_pipeline.prefix) as client:
        sub = await client.submit(Request(id=new_id(), deadline_ms=120_000, parts=(
            Part(Modality.TEXT, text="still answered"), Part("doc", data=b"\xff\xfe not utf-8"))))
        partial = await sub.result(timeout_s=150)
        unknown = await client.submit(Request(id=new_id(), parts=(Part("smell", data=b"\x00"),)))
        refused = await unknown.result(timeout_s=60)
    assert partial.kind == "result" and partial.payload["partial"]
    error = partial.payload["parts"][1]["error"]
    assert error["code"] == "unsupported_media" and error["field"] == "parts.1.data"
    assert refused.kind == "error" and refused.error["code"] == "unsupported_media"
    assert refused.error["field"] == "parts.0.modality" and "doc" in refused.error["message"]


async def test_a_doc_grounds_a_real_generation(doc_pipeline):
    async with Client(doc_pipeline.bootstrap, doc_pipeline.prefix) as client:
        sub = await client.submit(Request(
            id=new_id(), task=Task.GENERATE, deadline_ms=150_000, params=Params(max_tokens=24),
            parts=(Part("doc", data=b"Memo: the password for the staff room is BLUEBERRY."),
                   Part(Modality.TEXT, text="According to the memo, what is the password for the staff room?"))))
        event = await sub.result(timeout_s=180)
    assert event.kind == "result", event
    # What the generator was told about the doc: its modality's grounding, forwarded by the assembler.
    assert event.payload["parts"][0] == {"modality": "doc",
                                         "text": "Memo: the password for the staff room is BLUEBERRY."}
    assert "blueberry" in event.payload["text"].lower(), event.payload["text"]
