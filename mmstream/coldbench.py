"""Cold starts, measured: how long a new replica of each stage takes to serve, on a pipeline of
its own (a unique topic prefix on the running broker and Redis: `mmstream up --infra-only`).

    python -m mmstream.coldbench --stages encode.text,encode.image,encode.audio,generate --runs 3 --out cold.json
    python -m mmstream.coldbench ... --spare     # each replica from a warm spare, as the local scaler starts them

For each stage and run: a replica is spawned the way the supervisor spawns one (a fresh
process), a request that needs it is sent at the moment of the spawn, and three numbers are
kept: spawn -> ready and spawn -> first answered item (the replica's own
``mmstream_cold_start_seconds``, counted from its fork) and send -> answer (what the client
waited). The replica is stopped between runs, so every run is cold for the process but warm
for the machine (page cache, the calibration file: docs/autoscaling.md says which is which).
The router, the assembler and one text encoder stay up throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mmstream.samples import photo, video
from mmstream.supervisor import Supervisor
from schemas.request import Modality, Params, Part, Request, Task
from schemas.settings import Settings
from streams.sdk.client import Client, new_id, wait_until_serving
from streams.runtime.parent import PARENT_PID_ENV
from streams.topics import ensure_topics, topic_specs


def _wav(seconds: float = 1.0) -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\x00\x00" * int(16000 * seconds))
    return buf.getvalue()


def request_for(stage: str) -> Request:
    parts = {
        "encode.text": (Part(Modality.TEXT, text="a cold start"),),
        "encode.image": (Part(Modality.IMAGE, data=photo("chelsea"), mime="image/jpeg"),),
        "encode.audio": (Part(Modality.AUDIO, data=_wav(), mime="audio/wav"),),
        "encode.video": (Part(Modality.VIDEO, data=video(["chelsea"], seconds_each=0.5), mime="video/mp4"),),
        "generate": (Part(Modality.TEXT, text="Say hi."),),
    }[stage]
    task = Task.GENERATE if stage == "generate" else Task.EMBED
    params = Params(max_tokens=4) if task == Task.GENERATE else Params()
    return Request(id=new_id(), parts=parts, task=task, params=params, deadline_ms=120_000)


def cold_start(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["phase"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "mmstream_cold_start_seconds"}


async def spare_ready(sup: Supervisor, timeout_s: float = 60.0) -> None:
    """Until the warm spare has done its imports and waits on its FIFO."""
    spare = await asyncio.to_thread(sup.ensure_spare)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "waiting for a stage" in Path(spare.log_file).read_text(errors="replace")[-4000:]:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("the warm spare did not get ready")


async def one_run(sup: Supervisor, settings: Settings, stage: str) -> dict[str, Any]:
    if sup.spares:
        await spare_ready(sup)
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix) as client:
        w = sup.spawn_missing(stage, 1)[0]
        sent = time.monotonic()
        sub = await client.submit(request_for(stage))
        event = await sub.result(timeout_s=150)
        waited = time.monotonic() - sent
    phases: dict[str, float] = {}
    for _ in range(100):
        port = w.metrics_port
        if port:
            phases = cold_start(port)
            if "first_answer" in phases:
                break
        await asyncio.sleep(0.1)
    await asyncio.to_thread(sup.stop_beyond, stage, 0)
    return {"stage": stage, "outcome": event.kind, "ready_s": phases.get("ready"),
            "first_answer_s": phases.get("first_answer"), "client_waited_s": round(waited, 3)}


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for stage in dict.fromkeys(r["stage"] for r in runs):
        mine = [r for r in runs if r["stage"] == stage]
        out[stage] = {k: (round(statistics.median(v), 3) if (v := [r[k] for r in mine if r[k] is not None]) else None)
                      for k in ("ready_s", "first_answer_s", "client_waited_s")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmstream.coldbench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="encode.text,encode.image,encode.audio,generate")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--spare", action="store_true",
                    help="start each replica from a warm spare (mmstream.standby), as the local scaler does")
    args = ap.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    env = {**os.environ, "MMSTREAM_KAFKA_TOPIC_PREFIX": f"cold{uuid.uuid4().hex[:8]}",
           "MMSTREAM_LOCAL_METRICS_BASE_PORT": "0", "MMSTREAM_ROUTER_SERVED_MODALITIES": "text,image,audio,video",
           PARENT_PID_ENV: str(os.getpid())}
    settings = Settings.from_env(env)
    asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka, settings.dlq)))
    sup = Supervisor(settings, env)
    sup.start({"router": 1, "assembler": 1, "encode.text": 1})
    sup.spares = args.spare
    runs: list[dict[str, Any]] = []
    try:
        asyncio.run(wait_until_serving(settings.kafka.bootstrap, settings.kafka.topic_prefix, 180))
        for stage in stages:
            if stage == "encode.text":
                sup.stop_beyond("encode.text", 0)
            for i in range(args.runs):
                r = asyncio.run(one_run(sup, settings, stage))
                runs.append(r)
                print(json.dumps(r), flush=True)
            if stage == "encode.text":
                sup.spawn_missing("encode.text", 1)
    finally:
        sup.stop()
    report = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}, "spare": args.spare, "runs": runs,
              "p50": summary(runs)}
    print(json.dumps(report["p50"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
