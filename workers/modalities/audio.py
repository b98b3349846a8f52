"""The audio modality: Whisper through CTranslate2, a transcript plus the speech-pooled
encoder embedding (``workers/audio.py``). A unit of cost is one 30 s Whisper window of the
clip's duration bound (``workers.audio_header``), which its worker holds the clip to. Its
compute (``audio_runner``) loads only in its workers."""

from __future__ import annotations

from typing import Any, Mapping

from workers import prompt as P
from workers.audio_header import seconds_bound, windows
from workers.modalities.spec import ModalitySpec


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"transcript": extras.get("transcript", "")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.AudioPart(grounded.get("transcript", "") or "", failed=bool(grounded.get("failed")))


def _windows(head: bytes, size: int, limits: Any) -> float:
    return windows(seconds_bound(head, size, limits.max_audio_seconds))


SPEC = ModalitySpec(
    name="audio",
    runner="workers.modalities.audio_runner:build_runner",
    model_setting="audio_model",
    recipe="whisper-base",
    cost_unit="window",
    ms_per_unit=300.0,  # per 30 s Whisper window
    head_units=_windows,
    cache_ttl_s=3600,  # its own TTL: it used to borrow the image setting's
    grounding=_grounding,
    prompt_part=_prompt_part,
)
