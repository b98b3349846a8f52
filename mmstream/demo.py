"""`mmstream demo`: real requests through the running pipeline, their answers, and where
their time went."""

from __future__ import annotations

import numpy as np
from rich.console import Console

from mmstream import samples
from mmstream.console import latency_table
from schemas.request import Lane, Modality, Params, Part, Request, Task
from schemas.settings import Settings
from schemas.tensor import from_wire
from streams.sdk.client import Client, new_id
from streams.connection import KafkaSecurity

TEXTS = [
    "A cat sleeps on a sunny windowsill.",
    "A kitten is napping in the warm sunlight by the window.",
    "The central bank raised interest rates by a quarter point.",
    "Kafka topics are split into partitions that consumers share.",
]


def _requests() -> list[tuple[str, Request]]:
    reqs = [(f"embed: {t}", Request(id=new_id(), parts=(Part(Modality.TEXT, text=t),))) for t in TEXTS]
    try:
        cat, coffee = samples.photo("chelsea"), samples.photo("coffee")
    except ImportError:  # scikit-image is a test/build dependency; the demo runs without it
        cat = coffee = None
    if cat:
        reqs.append(("text + 2 photos (cat, coffee)", Request(id=new_id(), parts=(
            Part(Modality.TEXT, text="what is in these photos?"),
            Part(Modality.IMAGE, data=cat, mime="image/jpeg"), Part(Modality.IMAGE, data=coffee, mime="image/jpeg")))))
        clip = samples.video(["chelsea", "coffee", "astronaut", "rocket"], seconds_each=1.0)
        reqs.append(("a 4 s video (frames on the image pool)", Request(id=new_id(), parts=(
            Part(Modality.VIDEO, data=clip, mime="video/mp4"),))))
        reqs.append(("a broken image beside a text", Request(id=new_id(), parts=(
            Part(Modality.TEXT, text="the text half still gets answered"),
            Part(Modality.IMAGE, data=b"\xff\xd8\xff not really a jpeg", mime="image/jpeg")))))
    reqs.append(("embed, bulk lane, 2 parts", Request(id=new_id(), lane=Lane.BULK, parts=(
        Part(Modality.TEXT, text="first part of a two-part request"), Part(Modality.TEXT, text="second part")))))
    speech = samples.speech("Kafka keeps light text from waiting behind heavy video.")
    if speech:
        reqs.append(("a spoken clip (espeak-ng)", Request(id=new_id(), parts=(
            Part(Modality.AUDIO, data=speech, mime="audio/wav"),))))
    return reqs


async def run_demo(settings: Settings) -> int:
    console = Console()  # the terminal's width; 80 columns when piped, which every table fits
    rows = []
    vectors: dict[str, np.ndarray] = {}
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix,
                      security=KafkaSecurity.from_settings(settings.kafka)) as client:
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
                    extras = part.get("extras") or {}
                    if extras.get("top5"):
                        console.print("    top labels: " + ", ".join(f"{label} ({p:.2f})" for label, p in extras["top5"][:3]))
                    if "transcript" in extras:
                        console.print(f"    transcript: {extras['transcript']!r} ({extras['speech_seconds']} s of speech)")
                    if extras.get("frame_labels"):
                        console.print(f"    {extras['frames_encoded']} frames of {extras['duration_s']} s, labels per frame: "
                                      + ", ".join(extras["frame_labels"]))
                elif part.get("error"):
                    console.print(f"  part {part['index']} ({part['modality']}): {part['error']['code']}: "
                                  f"{part['error']['message']}")
    labels = [f"embed: {t}" for t in TEXTS if f"embed: {t}" in vectors]
    if len(labels) >= 3:
        a, b, c = (vectors[labels[i]] for i in range(3))
        console.print(f"\ncosine(cat, kitten) = {float(a @ b):.3f}   cosine(cat, interest rates) = {float(a @ c):.3f}")
    console.print(latency_table(rows))
    await _stream_answer(settings, console)
    console.print("stop everything with: [bold]mmstream down[/bold]")
    return 0


async def _stream_answer(settings: Settings, console: Console) -> None:
    """A generate request whose answer is printed token by token as the events arrive."""

    parts = [Part(Modality.TEXT, text="What animal is in this picture? Answer in one sentence.")]
    try:
        parts.append(Part(Modality.IMAGE, data=samples.photo("chelsea"), mime="image/jpeg"))
    except ImportError:
        parts = [Part(Modality.TEXT, text="What is the capital of France?")]
    console.print(f"\n[bold]generate:[/bold] {parts[0].text} (+ {len(parts) - 1} photo)")
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix,
                      security=KafkaSecurity.from_settings(settings.kafka)) as client:
        sub = await client.submit(Request(id=new_id(), task=Task.GENERATE, parts=tuple(parts),
                                          params=Params(max_tokens=48), deadline_ms=120_000))
        async for event in sub.events(timeout_s=120):
            if event.kind == "token":
                console.print(event.payload["text"], end="", soft_wrap=True)
            elif event.kind == "result":
                t = event.timings or {}
                console.print(f"\n  ({event.payload['tokens']['completion']} tokens, finish: "
                              f"{event.payload['finish_reason']}, TTFT {t.get('ttft_ms', 0):.0f} ms, "
                              f"TPOT {t.get('tpot_ms') or 0:.0f} ms, e2e {t.get('e2e_ms', 0):.0f} ms)")
            elif event.kind == "error":
                console.print(f"\n  error {event.error['code']}: {event.error['message']}")
