"""Retrieval across vector spaces, on the real broker, Redis and models: image documents (inline
and by claim check) are indexed with the image encoder and found by image queries, and a text
model change re-embeds every collection in the background while the old index answers, then
the new one answers once it holds the whole collection."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import redis

from schemas.request import Modality, Part
from schemas.settings import Settings
from mmstream.bench.reembed import alias_version, linked_repository, ready_spaces
from schemas.topics import TopicNames
from mmstream.samples import photo
from streams.observe.topic_reader import read_to_end
from streams.sdk.client import Client
from streams.topics import collection_spec, ensure_topics
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration

TEXT_MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def spaces_pipeline(infra: Settings, tmp_path_factory):
    repo = linked_repository(Path(infra.models.repository), tmp_path_factory.mktemp("spaces") / "models")
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1, "index": 1,
                                  "retrieve": 1},
                          MMSTREAM_MODELS_REPOSITORY=str(repo),
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image",
                          MMSTREAM_ROUTER_TOPIC_CACHE_S="1",
                          MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT="60000")
    k = pipe.settings.kafka
    asyncio.run(ensure_topics(k.bootstrap, [collection_spec(k, "default", "album"),
                                             collection_spec(k, "default", "notes")]))
    pipe.repo = repo  # type: ignore[attr-defined]
    yield pipe
    pipe.supervisor.stop()


async def _ask(client: Client, collection: str, query: str | Part, k: int = 3) -> dict:
    sub = await client.retrieve(collection, query, k=k, deadline_ms=30_000)
    ev = await sub.result(timeout_s=60)
    return {"kind": ev.kind, "payload": ev.payload or {}, "error": ev.error or {}}


async def _until(client: Client, collection: str, query: str | Part, ok, timeout_s: float = 120.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        answer = await _ask(client, collection, query)
        if ok(answer) or time.monotonic() > end:
            return answer
        await asyncio.sleep(0.5)


def _ids(answer: dict) -> list[str]:
    return [h["id"] for h in answer["payload"].get("hits", [])]


async def test_image_documents_inline_and_by_claim_check_are_found_by_image_queries(spaces_pipeline):
    r = redis.Redis.from_url(spaces_pipeline.settings.redis.url)
    r.set("mm:claim:default:album-rocket", photo("rocket"), ex=600)
    async with Client(spaces_pipeline.bootstrap, spaces_pipeline.prefix) as client:
        await client.put_image("album", "chelsea", photo("chelsea"), caption="a cat", meta={"kind": "pet"})
        await client.put_image("album", "coffee", photo("coffee"), caption="a cup of coffee", meta={"kind": "pet"})
        await client.put_image("album", "rocket", ref="redis:mm:claim:default:album-rocket", caption="a rocket")
        await client.put_document("album", "note", "A passage about cars and engines.")
        query = Part(Modality.IMAGE, data=photo("rocket"), mime="image/jpeg")
        found = await _until(client, "album", query, lambda a: len(_ids(a)) == 3)
        assert found["kind"] == "result", found
        assert _ids(found)[0] == "rocket" and found["payload"]["hits"][0]["text"] == "a rocket"
        assert found["payload"]["hits"][0]["score"] > 0.99  # the same photo: the same vector
        assert "note" not in _ids(found)  # a passage lives in the text space
        assert found["payload"]["index"]["model"].startswith("efficientnet")
        text = await _until(client, "album", "engines", lambda a: bool(_ids(a)))
        assert _ids(text) == ["note"] and text["payload"]["index"]["model"].startswith(TEXT_MODEL)
        # A ref outside the tenant's namespace, or past retrieval.max_doc_image_bytes, is
        # refused alone (dead-lettered), and the rest indexed.
        r.set("mm:claim:other:secret", photo("rocket"), ex=600)
        r.set("mm:claim:default:huge", b"\x89PNG" + bytes(5 * 1024 * 1024), ex=600)
        await client.put_image("album", "stolen", ref="redis:mm:claim:other:secret")
        await client.put_image("album", "huge", ref="redis:mm:claim:default:huge", mime="image/png")
        await client.put_image("album", "coffee2", photo("coffee"), caption="the coffee again")
        again = await _until(client, "album", Part(Modality.IMAGE, data=photo("coffee"), mime="image/jpeg"),
                             lambda a: "coffee2" in _ids(a))
        assert "coffee2" in _ids(again) and not {"stolen", "huge"} & set(_ids(again))
    letters = await read_to_end(spaces_pipeline.bootstrap, f"{spaces_pipeline.prefix}.dlq")
    reasons = {r.key: dict(r.headers).get("x-mm-error", b"").decode() for r in letters}
    assert reasons[b"stolen"].startswith("invalid_request") and reasons[b"huge"].startswith("payload_too_large")


async def test_a_text_model_change_re_embeds_in_the_background_while_the_old_index_answers(spaces_pipeline):
    sup, repo = spaces_pipeline.supervisor, spaces_pipeline.repo
    async with Client(spaces_pipeline.bootstrap, spaces_pipeline.prefix) as client:
        for i in range(30):
            await client.put_document("notes", f"n{i}", f"Note {i}: the meeting about topic {i % 5} moved.")
        await client.put_document("notes", "volcano", "Volcanoes erupt molten rock called lava.")
        old = await _until(client, "notes", "molten rock", lambda a: "volcano" in _ids(a))
        old_model = old["payload"]["index"]["model"]
        version = alias_version(repo, TEXT_MODEL)
        # The indexing stage goes first: a new group re-embeds every collection into the new space.
        sup.stop_one(next(w for w in sup.workers() if w.stage == "index" and w.alive))
        sup.start({"index": 1})
        during = await _ask(client, "notes", "molten rock")
        assert during["kind"] == "result" and _ids(during)[0] == "volcano"  # the old index answers
        assert during["payload"]["index"]["model"] == old_model
        names = TopicNames(spaces_pipeline.prefix)
        end = time.monotonic() + 120
        while time.monotonic() < end:  # the re-embed ends and marks the collection ready in the new space
            ready = await ready_spaces(spaces_pipeline.bootstrap, names.vectors, "notes")
            if any(f"/{version}/" in m and len(ps) == spaces_pipeline.settings.kafka.partitions
                   for m, ps in ready.items()):
                break
            await asyncio.sleep(1)
        else:
            pytest.fail("the new space was never marked ready")
        # Then the stages that encode queries (the router runs a text encoder of its own,
        # `router.colocate`): queries now come in the new space, and the new index answers them.
        for stage in ("encode.text", "router"):
            sup.stop_one(next(w for w in sup.workers() if w.stage == stage and w.alive))
            sup.start({stage: 1})
        new = await _until(client, "notes", "molten rock",
                           lambda a: a["payload"].get("index", {}).get("model", old_model) != old_model)
        assert new["kind"] == "result", new
        assert new["payload"]["index"]["model"] == old_model.replace(f"/{int(version) - 1}/", f"/{version}/")
        assert _ids(new)[0] == "volcano" and new["payload"]["index"]["documents"] == 31
    shutil.rmtree(repo / TEXT_MODEL / version)
