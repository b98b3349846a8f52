"""Retrieval end to end on the real broker with the real text model: documents written to a
collection topic are indexed and found, filters and deletes hold, a tenant sees only its own
collections, a restarted retrieve stage answers from its snapshot, and a generate request
grounded in a collection names the passages it used."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from schemas.request import Modality, Params, Part, Request, Task
from streams.sdk.client import Client, new_id
from streams.observe.topic_reader import read_to_end
from streams.topics import collection_spec, ensure_topics
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration

DOCS = {
    "eiffel": ("The Eiffel Tower is a wrought-iron lattice tower in Paris, France.", {"kind": "place"}),
    "python": ("Python is a programming language that lets you work quickly.", {"kind": "software"}),
    "kafka": ("Apache Kafka is a distributed event streaming platform.", {"kind": "software"}),
    "banana": ("Bananas are long curved fruits with soft flesh and yellow skin.", {"kind": "food"}),
}


@pytest.fixture(scope="module")
def rag_pipeline(infra):
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "index": 1, "retrieve": 1,
                                  "generate": 1},
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text",
                          MMSTREAM_ROUTER_TOPIC_CACHE_S="1",  # new collection topics found within a second
                          MMSTREAM_RETRIEVAL_SNAPSHOT_EVERY_S="1",
                          MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT="60000")
    k = pipe.settings.kafka
    asyncio.run(ensure_topics(k.bootstrap, [collection_spec(k, "default", "kb"), collection_spec(k, "other", "kb"),
                                             collection_spec(k, "default", "sky"),
                                             collection_spec(k, "default", "churn")]))
    yield pipe
    pipe.supervisor.stop()


def _client(pipe) -> Client:
    return Client(pipe.bootstrap, pipe.prefix)


async def _search(client: Client, query: str, collection: str = "kb", **kw) -> dict:
    sub = await client.retrieve(collection, query, deadline_ms=30_000, **kw)
    ev = await sub.result(timeout_s=60)
    assert ev.kind in ("result", "error"), ev
    return {"kind": ev.kind, "payload": ev.payload or {}, "error": ev.error or {}}


async def _until(client: Client, query: str, ok, timeout_s: float = 90.0, **kw) -> dict:
    """Search until ``ok(answer)``: indexing is asynchronous (document -> vector -> index)."""
    end = time.monotonic() + timeout_s
    while True:
        answer = await _search(client, query, **kw)
        if ok(answer) or time.monotonic() > end:
            return answer
        await asyncio.sleep(0.5)


def _ids(answer: dict) -> list[str]:
    return [h["id"] for h in answer["payload"].get("hits", [])]


async def test_documents_are_indexed_found_filtered_updated_and_deleted(rag_pipeline):
    async with _client(rag_pipeline) as client:
        for doc_id, (text, meta) in DOCS.items():
            await client.put_document("kb", doc_id, text, meta)
        found = await _until(client, "Which tower stands in Paris?", lambda a: len(_ids(a)) == len(DOCS), k=4)
        assert found["kind"] == "result", found
        assert _ids(found)[0] == "eiffel"
        hit = found["payload"]["hits"][0]
        assert hit["text"] == DOCS["eiffel"][0] and hit["meta"] == {"kind": "place"} and 0 < hit["score"] <= 1.0001
        scores = [h["score"] for h in found["payload"]["hits"]]
        assert scores == sorted(scores, reverse=True)

        only = await _search(client, "Which tower stands in Paris?", k=4, where={"kind": "software"})
        assert sorted(_ids(only)) == ["kafka", "python"]
        either = await _search(client, "a yellow fruit", k=4, where={"kind": ["food", "place"]})
        assert _ids(either)[0] == "banana" and set(_ids(either)) == {"banana", "eiffel"}

        await client.put_document("kb", "banana", "Kafka streams records between services in real time.",
                                  {"kind": "software"})
        await client.delete_document("kb", "eiffel")
        after = await _until(client, "Which tower stands in Paris?",
                             lambda a: "eiffel" not in _ids(a) and len(_ids(a)) == 3, k=4)
        assert "eiffel" not in _ids(after) and len(_ids(after)) == 3
        fruit = await _search(client, "a yellow fruit", k=4, where={"kind": "food"})
        assert _ids(fruit) == []  # its document changed kind


async def test_a_tenant_searches_only_its_own_collections(rag_pipeline):
    async with Client(rag_pipeline.bootstrap, rag_pipeline.prefix) as client:
        # "other"'s collection of the same name, written straight to its topic.
        topic = f"{rag_pipeline.prefix}.docs.other.kb"
        await client._transport.send(topic, b"secret", b'{"text": "the vault code is 1234"}', [])
        await client.put_document("kb", "own", "A note about the weather today.", {})
        mine = await _until(client, "what is the vault code", lambda a: "own" in _ids(a), k=10)
        assert "secret" not in _ids(mine)
        sub = await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text="vault code"),),
                                          task=Task.RETRIEVE, params=Params(collection="nosuch"), deadline_ms=30_000))
        ev = await sub.result(timeout_s=60)
        assert ev.kind == "error" and ev.error["code"] == "invalid_request"


async def test_bad_documents_are_dead_lettered_and_indexing_goes_on(rag_pipeline):
    async with _client(rag_pipeline) as client:
        topic = client.collection_topic("kb")
        await client._transport.send(topic, b"broken", b"\xc1not msgpack", [])
        await client._transport.send(topic, b"empty", b'{"text": " "}', [])
        await client._transport.send(topic, b"big", b'{"text": "%s"}' % (b"x" * 9000), [])
        # (a record without a key never gets here: the broker refuses it on a compacted topic)
        await client.put_document("kb", "after-bad", "Volcanoes erupt molten rock called lava.", {})
        answer = await _until(client, "molten rock from a volcano", lambda a: "after-bad" in _ids(a), k=3)
        assert _ids(answer)[0] == "after-bad" and not {"broken", "empty", "big"} & set(_ids(answer))
    letters = await read_to_end(rag_pipeline.bootstrap, f"{rag_pipeline.prefix}.dlq")
    reasons = {r.key: dict(r.headers).get("x-mm-error", b"").decode() for r in letters}
    assert reasons[b"broken"].startswith("invalid_request") and reasons[b"big"].startswith("payload_too_large")
    assert reasons[b"empty"].startswith("invalid_request")


async def test_a_retrieval_augmented_answer_names_its_passages_and_reuses_their_prefix(rag_pipeline):
    async with _client(rag_pipeline) as client:
        # Two documents and k=2: both questions get the same passages, so the same prefix.
        await client.put_document("sky", "moon", "The Moon orbits the Earth about once every 27 days.", {})
        await client.put_document("sky", "sun", "The Sun is the star at the centre of the Solar System.", {})
        sub = await client.retrieve("sky", "the Moon's orbit", k=2, deadline_ms=30_000)
        end = time.monotonic() + 90
        while len(((await sub.result(timeout_s=60)).payload or {}).get("hits", [])) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.5)
            sub = await client.retrieve("sky", "the Moon's orbit", k=2, deadline_ms=30_000)
        answers = []
        for question in ("How long does the Moon take to orbit the Earth?",
                         "How many days does one orbit of the Moon take?"):
            sub = await client.submit(Request(id=new_id(), task=Task.GENERATE, parts=(Part(Modality.TEXT, text=question),),
                                              params=Params(max_tokens=16, collection="sky", k=2), deadline_ms=120_000))
            ev = await sub.result(timeout_s=180)
            assert ev.kind == "result", ev
            answers.append(ev.payload)
        for p in answers:
            assert p["collection"] == "sky" and [q["id"] for q in p["passages"]] == ["moon", "sun"]  # by id
            assert [q["n"] for q in p["passages"]] == [1, 2]
        assert answers[0]["tokens"]["cached"] == 0 and answers[1]["tokens"]["cached"] > 0  # the passages' KV reused


async def test_a_restarted_retrieve_stage_answers_from_its_snapshot(rag_pipeline):
    async with _client(rag_pipeline) as client:
        await client.put_document("kb", "glacier", "A glacier is a persistent body of dense ice.", {})
        await _until(client, "a slow river of ice", lambda a: "glacier" in _ids(a), k=3)
        await asyncio.sleep(2.5)  # past a snapshot period
        sup = rag_pipeline.supervisor
        old = next(w for w in sup.workers() if w.stage == "retrieve" and w.alive)
        sup.stop_one(old)
        sup.start({"retrieve": 1})
        answer = await _until(client, "a slow river of ice", lambda a: "glacier" in _ids(a), k=3, timeout_s=120)
        assert "glacier" in _ids(answer)
    new = next(w for w in sup.workers() if w.stage == "retrieve" and w.alive)
    assert new.pid != old.pid
    log = Path(new.log_file).read_text()
    assert "retrieve: restored" in log.split("retrieve: no snapshot")[-1]  # the last start restored


async def test_killing_the_indexing_and_retrieve_stages_mid_ingest_loses_no_document(rag_pipeline):
    """kill -9 of both stages while documents stream in: after they come back, the index
    holds exactly the collection the topic holds (its last record per id)."""
    sup = rag_pipeline.supervisor
    async with _client(rag_pipeline) as client:
        for i in range(120):
            await client.put_document("churn", f"d{i}", f"Passage number {i} about topic {i % 7}.", {"i": i})
            if i == 40:
                for stage in ("index", "retrieve"):
                    w = next(w for w in sup.workers() if w.stage == stage and w.alive)
                    sup.stop_one(w, sig=signal.SIGKILL)
            if i == 80:
                sup.start({"index": 1, "retrieve": 1})
        for i in range(0, 120, 3):  # a third deleted, a third rewritten
            await client.delete_document("churn", f"d{i}")
        for i in range(1, 120, 3):
            await client.put_document("churn", f"d{i}", f"Rewritten passage {i}.", {"i": -i})
        want = {f"d{i}" for i in range(120) if i % 3}
        answer = await _until(client, "passage", lambda a: (a["payload"].get("index") or {}).get("documents") == 80,
                              collection="churn", k=50, timeout_s=180)
        assert answer["payload"]["index"]["documents"] == 80
        everything = {h["id"]: h for h in (await _search(client, "Rewritten passage", collection="churn", k=50))["payload"]["hits"]}
        assert set(everything) <= want
        rewritten = [h for h in everything.values() if int(h["id"][1:]) % 3 == 1]
        assert rewritten and all(h["meta"]["i"] < 0 and h["text"].startswith("Rewritten") for h in rewritten)
