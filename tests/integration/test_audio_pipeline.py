"""Speech through the real pipeline: a clip spoken by espeak-ng is transcribed beside a
text part; silence is trimmed by the VAD and yields an empty transcript; clips sent one after
another are each admitted."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mmstream.samples import video
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id
from tests.integration.conftest import start_pipeline

pytestmark = pytest.mark.integration

SENTENCE = "please remember to water the plants and lock the back door before you leave"


def spoken(text: str) -> bytes:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.fail("espeak-ng is needed for the speech tests: apt-get install espeak-ng")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-w", str(out), text], check=True)
        return out.read_bytes()


def silence_wav(seconds: float = 2.0) -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.zeros(int(16000 * seconds), dtype=np.int16).tobytes())
    return buf.getvalue()


def wer(ref: str, hyp: str) -> float:
    r, h = ref.lower().split(), [w.strip(".,!?") for w in hyp.lower().split()]
    d = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)] / max(1, len(r))


async def test_speech_is_transcribed_and_silence_is_empty(infra):
    pipe = await asyncio.to_thread(start_pipeline, infra, {"router": 1, "assembler": 1, "encode.text": 1,
                                                           "encode.audio": 1, "encode.image": 1, "encode.video": 1},
                                   MMSTREAM_ROUTER_SERVED_MODALITIES="text,audio,image,video")
    try:
        async with Client(pipe.bootstrap, pipe.prefix) as client:
            sub = await client.submit(Request(id=new_id(), parts=(
                Part(Modality.TEXT, text="what does the clip say?"),
                Part(Modality.AUDIO, data=spoken(SENTENCE), mime="audio/wav"),
                Part(Modality.AUDIO, data=silence_wav(), mime="audio/wav"),
                Part(Modality.AUDIO, data=b"RIFF\x00\x00\x00\x00WAVEjunk", mime="audio/wav"),
                Part(Modality.VIDEO, data=video(["chelsea", "coffee"], soundtrack=spoken(SENTENCE)), mime="video/mp4")),
                deadline_ms=120_000))
            event = await sub.result(timeout_s=180)
            # A client that sends its next clip on its last one's answer, at the default rt bound
            # (500 ms: less than a clip costs here): the stage is idle each time, so each is
            # admitted, not refused behind the clip that just finished (the router reads the
            # stage's load from a report made while that clip ran).
            followups = []
            for i in range(3):
                nxt = await client.submit(Request(id=new_id(), parts=(
                    Part(Modality.AUDIO, data=spoken(f"{SENTENCE} {i}"), mime="audio/wav"),), deadline_ms=60_000))
                followups.append(await nxt.result(timeout_s=90))
    finally:
        await asyncio.to_thread(pipe.supervisor.stop)
    assert event.kind == "result" and event.payload["partial"]
    text, speech, silence, junk, clip = event.payload["parts"]
    transcript = speech["extras"]["transcript"]
    score = wer(SENTENCE, transcript)
    print(f"\ntranscript {transcript!r}: WER {score:.3f}")
    assert score <= 0.35
    assert speech["embedding"]["shape"] == [512]
    assert silence["extras"]["transcript"] == "" and silence["extras"]["speech_seconds"] == 0
    assert junk["error"]["code"] == "unsupported_media" and junk["error"]["field"] == "parts.3"
    assert [(f.kind, (f.error or {}).get("message")) for f in followups] == [("result", None)] * 3

    # A video's soundtrack goes to the audio pool; its transcript lands beside the frames.
    assert clip["extras"]["frames_encoded"] == 2 and clip["extras"]["complete"]
    assert wer(SENTENCE, clip["extras"]["transcript"]) <= 0.35, clip["extras"]["transcript"]
