"""After a short real run, every worker's /metrics has the families and labels the
dashboard relies on (parsed with prometheus-client's own parser)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id

pytestmark = pytest.mark.integration


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_workers_expose_stage_metrics_after_traffic(pipeline):
    run = new_id()  # texts never sent before: a whole-result cache hit would skip the encoder
    async with Client(pipeline.bootstrap, pipeline.prefix) as client:
        subs = [await client.submit(Request(id=new_id(), parts=(Part(Modality.TEXT, text=f"metrics {run} {i}"),)))
                for i in range(10)]
        await asyncio.gather(*(s.result(timeout_s=60) for s in subs))
        await client.submit_raw(new_id(), b"\xc1 not a request", "application/msgpack")
    await asyncio.sleep(6)  # one lag-monitor refresh
    workers = {w.stage: w for w in pipeline.supervisor.workers()}
    ports = {stage: w.metrics_port for stage, w in workers.items()}
    assert all(ports.values()), ports

    router = scrape(ports["router"])
    done = {(s.labels["stage"], s.labels["outcome"]): s.value for s in router["mmstream_requests"]
            if s.name.endswith("_total")}
    assert done[("route", "ok")] >= 10 and done[("route", "dlq")] >= 1
    assert any(s.labels == {"stage": "route", "modality": "text", "lane": "rt"}
               for s in router["mmstream_stage_queue_seconds"])

    # Text is placed in the router's process (router.colocate, the default): at this load
    # the router's own text encoder ran every batch; the text pool's replica is up, idle.
    assert any(s.name == "mmstream_batch_size_count" and s.labels["stage"] == "encode.text" and s.value >= 1
               for s in router["mmstream_batch_size"])
    encoder = scrape(ports["encode.text"])
    for family in (router, encoder):
        info = family["mmstream_engine_info"]  # the parser keeps the _info suffix of an info family
        assert info and info[0].labels["model"] == "all-minilm-l6-v2" and info[0].labels["provider"]

    # Each request's end-to-end time is recorded where its answer is sent: by the router for a
    # text its own encoder encoded (router.answer_local, the default), else by the assembler.
    assembler = scrape(ports["assembler"])
    text = {"modality": "text", "lane": "rt"}  # the session's pipeline may have answered other modalities too
    e2e = [s for family in (router, assembler) for s in family["mmstream_e2e_seconds"]
           if s.name == "mmstream_e2e_seconds_count" and s.labels == text]
    assert sum(s.value for s in e2e) >= 10
    assert any(s.value >= 1 for s in router["mmstream_e2e_seconds"]
               if s.name == "mmstream_e2e_seconds_count" and s.labels == text)

    lag = scrape(ports["lagmon"])["mmstream_consumer_lag"]
    groups = {s.labels["group"] for s in lag}
    assert {f"{pipeline.prefix}-router", f"{pipeline.prefix}-encode-text", f"{pipeline.prefix}-assembler"} <= groups
    # Encoders report their queued work and what an item costs them, for the router's admission.
    import json

    import redis

    reports = [json.loads(v) for v in
               redis.Redis.from_url(pipeline.settings.redis.url).hgetall(f"mm:load:{pipeline.prefix}").values()]
    text = [r for r in reports if r["stage"] == "encode.text"]
    assert text and all(float(ms) > 0 for ms in text[0]["item_ms"].values()) and text[0]["queued_ms"] >= 0
    for family in (router, encoder, assembler):
        for name, samples in family.items():
            for s in samples:
                assert "id" not in s.labels, f"{name} has a request-id label"


def probe(port: int, path: str) -> tuple[int, dict]:
    import json
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def test_every_running_worker_is_live_ready_and_reports_process_metrics(pipeline):
    for w in pipeline.supervisor.workers():
        port = w.metrics_port
        assert probe(port, "/healthz")[0] == 200, w.stage
        deadline = asyncio.get_running_loop().time() + 30  # the lag monitor is ready after its first read
        while (ready := probe(port, "/readyz"))[0] != 200 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(1)
        assert ready == (200, {"ok": True, "stage": w.stage, "checks": ready[1]["checks"]}), (w.stage, ready)
        assert all(ready[1]["checks"].values()) and ready[1]["checks"]
        metrics = scrape(port)
        assert [s.value for s in metrics["mmstream_ready"]] == [1.0], w.stage
        assert metrics["process_resident_memory_bytes"][0].value > 0
        assert "mmstream_inflight" in metrics
