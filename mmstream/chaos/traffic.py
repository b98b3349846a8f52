"""Mixed traffic for a chaos run: text, images, video, audio and generate requests on the rt
and bulk lanes, at a fixed rate (open loop: a fault never slows the sender down), every
choice from one seeded random source so a scenario sends the same traffic each time.

Images, video and audio are made on the spot (``mmstream.samples``); media goes by claim
check through Redis (the chaos client's inline limit is small on purpose), so Redis faults
meet claim checks in flight.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from mmstream import samples
from mmstream.chaos.scenario import Scenario
from schemas.request import Lane, Modality, Params, Part, Request, Task
from streams.sdk.client import Client, Submission

INLINE_LIMIT_BYTES = 16 * 1024
"""Smaller than every sample image: media travels by claim check."""
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@dataclass
class Sent:
    id: str
    kind: str
    lane: str
    sent_at: float
    """time.monotonic() when the client was asked to send it: a send that waits for a broker
    that is away counts that wait (what a caller sees), and falls in the fault's window."""
    sub: Submission | None
    """None: the client could not send it (the broker or Redis away at that moment); such a
    request is no one's to answer and is left out of the checks."""
    answered_at: float | None = None
    """time.monotonic() when its terminal event reached the client."""
    outcome: str | None = None


@dataclass
class Media:
    images: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)


def make_media(scenario: Scenario) -> Media:
    media = Media()
    if scenario.mix.get("image") or scenario.mix.get("video"):
        media.images = [samples.photo(p) for p in PHOTOS]
    if scenario.mix.get("video"):
        media.videos = [samples.video([p], seconds_each=1.0, fps=4, size=(160, 120), tag=i)
                        for i, p in enumerate(PHOTOS[:2])]
    if scenario.mix.get("audio"):
        spoken = [samples.speech(t) for t in ("the pipeline keeps every answer", "one answer per request")]
        media.audio = [a for a in spoken if a]
    return media


def request_for(i: int, kind: str, lane: str, media: Media, scenario: Scenario, rng: random.Random) -> Request:
    text = f"{scenario.name} request {i}: the {rng.choice(['red', 'green', 'blue'])} pipeline answers once"
    task = Task.EMBED
    params = Params()
    if kind == "text":
        parts = (Part(Modality.TEXT, text=text),)
    elif kind == "image":
        parts = (Part(Modality.TEXT, text=text), Part(Modality.IMAGE, data=rng.choice(media.images), mime="image/jpeg"))
    elif kind == "video":
        parts = (Part(Modality.VIDEO, data=rng.choice(media.videos), mime="video/mp4"),)
    elif kind == "audio":
        parts = (Part(Modality.AUDIO, data=rng.choice(media.audio), mime="audio/wav"),)
    else:
        parts = (Part(Modality.TEXT, text=f"Say one short sentence about request {i}."),)
        task = Task.GENERATE
        params = Params(max_tokens=scenario.max_tokens, temperature=0.0)
    return Request(id=f"{scenario.name}-{i:05d}-{rng.getrandbits(32):08x}", parts=parts, task=task,
                   lane=Lane(lane), deadline_ms=scenario.deadline_ms, params=params)


def plan(scenario: Scenario) -> list[tuple[float, str, str]]:
    """(offset seconds, kind, lane) of every request, in order."""
    rng = random.Random(scenario.seed)
    kinds, weights = zip(*scenario.mix.items())
    n = max(1, int(scenario.seconds * scenario.rate))
    return [(i / scenario.rate, rng.choices(kinds, weights)[0],
             "bulk" if rng.random() < scenario.bulk_share else "rt") for i in range(n)]


SUBMIT_TIMEOUT_S = 30.0
"""How long one send may wait (for a broker or Redis that is away) before the request counts
as never sent: longer than the outages the scenarios make, so a request tried during one is
sent when it can be and its wait is counted, not left out."""


async def send_all(client: Client, scenario: Scenario, media: Media, started: float) -> list[Sent]:
    """Send the planned requests at their times, each on its own (open loop: a send waiting
    for a broker that is away holds up no other request); return them in plan order (answers
    arrive on ``sub``)."""
    rng = random.Random(scenario.seed + 1)
    planned = [(offset, kind, request_for(i, kind, lane, media, scenario, rng))
               for i, (offset, kind, lane) in enumerate(plan(scenario))]

    async def one(offset: float, kind: str, req: Request) -> Sent:
        delay = started + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tried_at = time.monotonic()
        try:
            sub: Submission | None = await asyncio.wait_for(client.submit(req), SUBMIT_TIMEOUT_S)
        except Exception:  # the broker or Redis away too long: never sent, so never answered
            sub = None
        return Sent(req.id, kind, req.lane.value, tried_at, sub)

    return list(await asyncio.gather(*(one(offset, kind, req) for offset, kind, req in planned)))


async def follow(sent: list[Sent], timeout_s: float) -> None:
    """Wait until every request has its terminal event or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s

    async def one(s: Sent) -> None:
        if s.sub is None:
            return
        left = deadline - time.monotonic()
        try:
            ev = await s.sub.result(max(0.1, left))
        except (asyncio.TimeoutError, Exception):
            return
        # When the answer reached the client (the SDK stamps its arrival), not when this
        # loop — which starts only once every request is sent — got to it.
        arrived_ms = s.sub.terminal_at_ms
        s.answered_at = (time.monotonic() if arrived_ms is None
                         else arrived_ms / 1000.0 - (time.time() - time.monotonic()))
        s.outcome = "result" if ev.kind == "result" else f"error:{(ev.error or {}).get('code')}"

    await asyncio.gather(*(one(s) for s in sent))
