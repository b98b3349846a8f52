"""The video modality: it encodes nothing itself. The video stage (``streams/stages/video.py``,
over ``workers/video.py``) samples frames and fans them out in chunks to the image pool, and
the soundtrack to the audio pool; the assembler pools the chunks into one part again.

Its cost is ``max_frames`` image units, charged to the image pool that does the work, and
its soundtrack's windows at the audio pool, read from its container
(``workers.video_header``).
"""

from __future__ import annotations

from typing import Any, Mapping

from workers import prompt as P
from workers.audio_header import windows
from workers.video_header import soundtrack_seconds
from workers.modalities.spec import ModalitySpec


def _frames(size: int, max_frames: int) -> float:
    return float(max_frames)


def _soundtrack(data: bytes, settings: Any) -> dict[str, float]:
    seconds = soundtrack_seconds(data, min(settings.video.max_seconds, settings.limits.max_audio_seconds))
    return {"audio": windows(seconds)} if seconds > 0 else {}


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"frames": extras.get("frame_top", []), "transcript": extras.get("transcript")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    frames = [P.FrameLabels(float(at), [P.Label(str(name), float(score)) for name, score in (top or [])])
              for at, top in (grounded.get("frames") or [])]
    return P.VideoPart(frames, grounded.get("transcript"), failed=bool(grounded.get("failed")))


SPEC = ModalitySpec(
    name="video",
    fanout=("image", "audio"),
    cost_unit="frame",
    ms_per_unit=8.0,  # per sampled frame (frames go to the image pool)
    units=_frames,
    fanout_units=_soundtrack,
    grounding=_grounding,
    prompt_part=_prompt_part,
)
