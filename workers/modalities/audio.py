"""The audio modality: Whisper through CTranslate2, a transcript plus the speech-pooled
encoder embedding (``workers/audio.py``). One clip is one unit of cost (a 30 s window). Its
compute (``audio_runner``) loads only in its workers."""

from __future__ import annotations

from typing import Any, Mapping

from workers import prompt as P
from workers.modalities.spec import ModalitySpec


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"transcript": extras.get("transcript", "")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.AudioPart(grounded.get("transcript", "") or "", failed=bool(grounded.get("failed")))


SPEC = ModalitySpec(
    name="audio",
    runner="workers.modalities.audio_runner:build_runner",
    model_setting="audio_model",
    recipe="whisper-base",
    cost_unit="clip",
    ms_per_unit=300.0,  # per clip (30 s Whisper window)
    cache_ttl_s=3600,  # its own TTL: it used to borrow the image setting's
    grounding=_grounding,
    prompt_part=_prompt_part,
)
