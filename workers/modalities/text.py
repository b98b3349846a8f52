"""The text modality, as the topology sees it: a sentence-embedding model over normalized text,
cost counted in tokens (about four characters each, as the router sees them), text parts read
by the language model as they are. Its compute (``text_runner``) loads only in its workers.
"""

from __future__ import annotations

from typing import Any, Mapping

from workers import prompt as P
from workers.modalities.spec import ModalitySpec


def _tokens(size: int, max_frames: int) -> float:
    return max(1.0, size / 4.0)


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"text": extras.get("text", "")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.TextPart(grounded.get("text", ""))


SPEC = ModalitySpec(
    name="text",
    runner="workers.modalities.text_runner:build_runner",
    model_setting="text_model",
    recipe="all-minilm-l6-v2",
    cost_unit="token",
    ms_per_unit=0.15,  # per token, padded batch on 2 CPU threads
    units=_tokens,
    ttl_setting="ttl_text_s",
    grounding=_grounding,
    prompt_part=_prompt_part,
)
