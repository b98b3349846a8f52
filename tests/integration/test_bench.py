"""The bench against real workers and the real models: both modes produce valid JSON,
and `mmstream top --once` shows every stage of the pipeline."""

from __future__ import annotations

import pytest
from rich.console import Console

from mmstream.bench import BenchConfig, run_bench
from mmstream.bench.retrieval_run import run_retrieval
from mmstream.report import validate, write_report
from mmstream.top import run_top
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["pipeline", "monolithic"])
async def test_a_short_bench_run_produces_valid_json(pipeline, mode, tmp_path) -> None:
    cfg = BenchConfig(workload="text", rate=4.0, duration_s=5.0, drain_s=20.0, seed=5, mode=mode)
    doc = await run_bench(pipeline.settings, cfg, progress=False)
    [run] = validate(doc)
    assert run["mode"] == mode
    assert run["requests"]["sent"] > 5 and run["requests"]["lost"] == 0
    assert run["requests"]["ok"] == run["requests"]["sent"]
    assert run["floor_ms"]["encode.text"] > 0
    assert "encode.text" in run["latency_ms"]["text"]["stages"]
    assert run["cpu"]["per_request_ms"] > 0
    if mode == "pipeline":
        assert {"router[0]", "encode.text[0]", "assembler[0]"} <= set(run["cpu"]["per_process_s"])
        assert run["cache"]["tenant"].startswith("bench-")
    assert write_report([doc], tmp_path).is_file()


async def test_top_once_shows_every_stage(pipeline) -> None:
    console = Console(record=True, width=200)
    assert await run_top(pipeline.settings, once=True, interval_s=0.5, console=console) == 0
    text = console.export_text()
    running = {w.stage for w in pipeline.supervisor.workers() if w.alive}
    assert running
    for stage in running:
        assert stage in text
    assert f"{pipeline.prefix}.ingress.rt" in text


async def test_the_monolith_serves_every_modality_and_generation(infra, monkeypatch) -> None:
    """The baseline runs the mixed workload's video and audio and the chat workload's
    generation with the pipeline's engines (no broker needed: it is one process)."""
    from dataclasses import replace

    from mmstream.bench import workloads

    # Every request one of the media kinds, so a short run sees video and audio.
    monkeypatch.setattr(workloads, "MIXED_KINDS", (("text+video", 0.5), ("text+audio", 0.5)))
    mixed = BenchConfig(workload="mixed", rate=6.0, duration_s=6.0, drain_s=60.0, seed=3, mode="monolithic")
    [run] = validate(await run_bench(infra, mixed, progress=False))
    assert run["requests"]["ok"] == run["requests"]["sent"] > 0
    assert {"text+video", "text+audio"} <= set(run["latency_ms"])
    stages = {s for kind in run["latency_ms"].values() for s in kind["stages"]}
    assert {"encode.video", "encode.audio"} <= stages

    chat = replace(mixed, workload="chat", rate=1.0, duration_s=4.0)
    [gen] = validate(await run_bench(infra, chat, progress=False))
    assert gen["requests"]["ok"] == gen["requests"]["sent"] > 0
    assert gen["generation"]["ttft_ms"]["count"] == gen["requests"]["ok"] and gen["generation"]["ttft_ms"]["p50"] > 0


@pytest.fixture(scope="module")
def small_bounds(infra):
    """A pipeline of its own whose bounds are small, so the abuser's worst requests are cheap
    here: its flood must not leave work queued in the shared pipeline the later tests use
    (on the full bounds, 25-Mpixel PNGs kept a CI box's image encoder busy past the drain)."""
    pipe = start_pipeline(infra, {"router": 1, "assembler": 1, "encode.text": 1, "encode.image": 1},
                          MMSTREAM_LIMITS_MAX_PARTS="4", MMSTREAM_LIMITS_MAX_TEXT_BYTES="4096",
                          MMSTREAM_LIMITS_MAX_IMAGE_PIXELS=str(320 * 240),
                          MMSTREAM_LIMITS_MAX_REQUEST_REF_BYTES=str(1024 * 1024),
                          MMSTREAM_ROUTER_SERVED_MODALITIES="text,image")
    yield pipe
    pipe.supervisor.stop()


async def test_the_fairness_run_loses_nothing_of_either_tenant(small_bounds) -> None:
    """A short fairness run: invariants only (latency on a shared box says nothing). A's
    deadline is short, so every one of its requests is answered, shed or expired within the
    drain."""
    from mmstream.bench import run_fairness

    cfg = BenchConfig(workload="fairness", rate=4.0, duration_s=3.0, drain_s=25.0, seed=11, abuse_rate=6.0,
                      abuse_deadline_ms=8_000, floor_repeats=3)
    doc = await run_fairness(small_bounds.settings, cfg, progress=False)
    for phase in ("alone", "flood"):
        validate(doc["phases"][phase])
    v, a = doc["victim"], doc["abuser"]
    assert v["sent"]["alone"] == v["sent"]["flood"] > 5
    assert v["lost"] == {"alone": 0, "flood": 0}
    assert a["sent"] == a["planned"] > 5 and a["lost"] == a["pending"] == a["unsent"] == 0
    assert sum(a["by_outcome"].values()) == a["sent"]  # one terminal event each
    assert "max_generate" not in doc["abuse_shapes"]  # no generator in this pipeline
    assert {"router[0]", "encode.text[0]"} <= set(doc["memory"])
    assert all(m["series"] for m in doc["memory"].values())


async def test_the_retrieve_run_indexes_its_corpus_and_answers_every_search(infra) -> None:
    cfg = BenchConfig(workload="retrieve", rate=5.0, duration_s=3.0, drain_s=30.0, seed=2, repeat=0.5, docs=40)
    doc = await run_retrieval(infra, cfg, progress=False)
    [run] = doc["runs"]
    assert doc["documents"] == 40 and run["requests"]["lost"] == 0 and run["requests"]["ok"] == run["requests"]["sent"]
    assert run["retrieval"]["retrieve_service_ms"]["count"] == run["requests"]["ok"]
    assert run["latency_ms"]["retrieve"]["e2e"]["count"] == run["requests"]["ok"]
    recall = run["retrieval"]["recall"]  # from the retrieve stage's own snapshot of the 40 passages
    assert recall is not None and recall["queries"] == run["requests"]["ok"]
    assert recall["reused"]["queries"] + recall["searched"]["queries"] == recall["queries"]
    assert 0.0 < recall["plain"] <= 1.0 and 0.0 < recall["answered"] <= 1.0
