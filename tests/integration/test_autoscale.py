"""The local scaler on a real pipeline: an idle pool whose minimum is 0 stops, the first record
for it wakes it (from the warm spare, which another spare then replaces), the request is
answered, and the new replica reports its cold start."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmstream.supervisor import AUTOSCALER, SPARE
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import Pipeline, start_pipeline
from tests.integration.test_audio_pipeline import silence_wav

pytestmark = pytest.mark.integration


def live(pipe: Pipeline, stage: str) -> list:
    return [w for w in pipe.supervisor.workers() if w.alive and w.stage == stage]


def decisions(pipe: Pipeline) -> list[dict]:
    f = Path(pipe.supervisor.dir) / "autoscale.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def until(what, timeout_s: float, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        await asyncio.sleep(every_s)
    return what()


async def test_an_idle_pool_scales_to_zero_and_its_first_record_wakes_it(infra):
    pipe = await asyncio.to_thread(
        start_pipeline, infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.audio": 1, AUTOSCALER: 1},
        MMSTREAM_ROUTER_SERVED_MODALITIES="text,audio",
        MMSTREAM_AUTOSCALE_POOLS="encode.audio=0:1,encode.text=1:1",
        MMSTREAM_AUTOSCALE_IDLE_S="3", MMSTREAM_AUTOSCALE_INTERVAL_S="0.5")
    try:
        assert await until(lambda: not live(pipe, "encode.audio"), 90), "the idle audio pool never stopped"
        assert any(d["stage"] == "encode.audio" and d["to"] == 0 and d["reason"] == "idle" for d in decisions(pipe))
        assert len(live(pipe, "encode.text")) == 1  # its minimum: never below
        (spare,) = await until(lambda: live(pipe, SPARE), 60)
        assert await until(lambda: "waiting for a stage" in Path(spare.log_file).read_text(errors="replace"), 90)

        sent = time.monotonic()
        async with Client(pipe.bootstrap, pipe.prefix) as client:
            sub = await client.submit(Request(id=new_id(), parts=(
                # Text of its own each run: the router's whole-answer cache (keyed by tenant and content, not by
                # the topic prefix) must not answer it from an earlier run on the same Redis, or no record
                # would reach the pool it should wake.
                Part(Modality.TEXT, text=f"and the clip? {new_id()}"),
                Part(Modality.AUDIO, data=silence_wav(1.0), mime="audio/wav")),
                deadline_ms=120_000))
            event = await sub.result(timeout_s=150)
        answered_s = time.monotonic() - sent
        assert event.kind == "result", event.payload
        assert [s["stage"] for s in event.timings["stages"]] != ["route"], "answered by the router's cache"
        text, audio = event.payload["parts"]
        assert audio.get("error") is None and audio["extras"]["transcript"] == ""
        wake = [d for d in decisions(pipe) if d["stage"] == "encode.audio" and d["reason"] == "wake"]
        assert wake and wake[-1]["from"] == 0 and wake[-1]["to"] == 1
        (w,) = live(pipe, "encode.audio")
        assert w.pid == spare.pid  # the warm spare became the replica...
        assert await until(lambda: [s for s in live(pipe, SPARE) if s.pid != spare.pid], 30)  # ...and has a successor
        port = await until(lambda: w.metrics_port, 30)
        m = scrape(port)
        ready = m[("mmstream_cold_start_seconds", frozenset({("stage", "encode.audio"), ("phase", "ready")}))]
        first = m[("mmstream_cold_start_seconds", frozenset({("stage", "encode.audio"), ("phase", "first_answer")}))]
        assert 0 < ready <= first
        print(f"\nwoken pool: request answered {answered_s:.2f} s after it was sent; replica ready {ready:.2f} s "
              f"after its start (fork or hand-over), first answer {first:.2f} s")

        (scaler,) = live(pipe, AUTOSCALER)
        sm = scrape(scaler.metrics_port)
        assert sm[("mmstream_autoscale_decisions_total",
                   frozenset({("stage", "encode.audio"), ("reason", "wake"), ("held", "false")}))] >= 1
        assert sm[("mmstream_autoscale_replicas", frozenset({("stage", "encode.audio")}))] >= 0
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    assert not pipe.supervisor.workers() or not any(w.alive for w in pipe.supervisor.workers())
