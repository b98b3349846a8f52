"""The image modality: an ImageNet classifier's embedding and top labels (``workers/image.py``).

The image pool also encodes video frame chunks (``FRAMES_MIME``, from the video stage):
their output is the SUM of the frames' embeddings, which the assembler pools. One image or
frame is one unit of cost (every picture is resized to 224x224 before the engine). Its compute
(``image_runner``) loads only in its workers.
"""

from __future__ import annotations

from typing import Any, Mapping

from workers import prompt as P
from workers.modalities.spec import ModalitySpec


def _labels(pairs: Any) -> list[P.Label]:
    return [P.Label(str(name), float(score)) for name, score in (pairs or [])]


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"labels": extras.get("top5", [])}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.ImagePart(_labels(grounded.get("labels")), failed=bool(grounded.get("failed")))


SPEC = ModalitySpec(
    name="image",
    runner="workers.modalities.image_runner:build_runner",
    model_setting="image_model",
    recipe="efficientnet-lite0",
    cost_unit="image",
    ms_per_unit=8.0,  # per image at 224x224
    ttl_setting="ttl_image_s",
    grounding=_grounding,
    prompt_part=_prompt_part,
)
