"""`mmstream demo`: real requests through the running pipeline, their answers, and where
their time went."""

from __future__ import annotations

import asyncio
import json

import numpy as np
from rich.console import Console

from schemas.request import Lane, Modality, Part, Request
from schemas.tensor import from_wire
from streams.client import Client, new_id
from streams.console import latency_table
from streams.settings import Settings

TEXTS = [
    "A cat sleeps on a sunny windowsill.",
    "A kitten is napping in the warm sunlight by the window.",
    "The central bank raised interest rates by a quarter point.",
    "Kafka topics are split into partitions that consumers share.",
]


def _requests() -> list[tuple[str, Request]]:
    reqs = [(f"embed: {t}", Request(id=new_id(), parts=(Part(Modality.TEXT, text=t),))) for t in TEXTS]
    reqs.append(("embed, bulk lane, 2 parts", Request(id=new_id(), lane=Lane.BULK, parts=(
        Part(Modality.TEXT, text="first part of a two-part request"), Part(Modality.TEXT, text="second part")))))
    reqs.append(("text + image (no image pool yet)", Request(id=new_id(), parts=(
        Part(Modality.TEXT, text="a text beside an image part"), Part(Modality.IMAGE, data=b"not really a png", mime="image/png")))))
    return reqs


async def run_demo(settings: Settings) -> int:
    console = Console(width=max(120, Console().width))
    rows = []
    vectors: dict[str, np.ndarray] = {}
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix) as client:
        subs = [(label, await client.submit(req)) for label, req in _requests()]
        for label, sub in subs:
            event = await sub.result(timeout_s=60)
            e2e = (sub.terminal_at_ms or 0) - sub.sent_at_ms
            rows.append((label, event, e2e))
            console.print(f"[bold]{label}[/bold] -> {event.kind}")
            if event.error:
                console.print(f"  error {event.error['code']}: {event.error['message']}")
            for part in (event.payload or {}).get("parts", []):
                if part.get("embedding"):
                    vec = from_wire(part["embedding"]).astype(np.float32)
                    vectors.setdefault(label, vec)
                    console.print(f"  part {part['index']} ({part['modality']}): embedding {vec.shape[0]}-d, "
                                  f"norm {np.linalg.norm(vec):.3f}, first values {[round(float(x), 3) for x in vec[:3]]}")
                elif part.get("error"):
                    console.print(f"  part {part['index']} ({part['modality']}): {part['error']['code']}: "
                                  f"{part['error']['message']}")
    labels = [f"embed: {t}" for t in TEXTS if f"embed: {t}" in vectors]
    if len(labels) >= 3:
        a, b, c = (vectors[labels[i]] for i in range(3))
        console.print(f"\ncosine(cat, kitten) = {float(a @ b):.3f}   cosine(cat, interest rates) = {float(a @ c):.3f}")
    console.print(latency_table(rows))
    console.print("stop everything with: [bold]mmstream down[/bold]")
    return 0
