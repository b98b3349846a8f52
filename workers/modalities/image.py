"""The image modality: an ImageNet classifier's embedding and top labels (``workers/image.py``).

The image pool also encodes video frame chunks (``FRAMES_MIME``, from the video stage):
their output is the SUM of the frames' embeddings, which the assembler pools. One image or
frame is one unit of the engine's cost (every picture is resized to 224x224 before the
engine); an image's decode is priced on top, from its header (``workers.image_header``). Its compute
(``image_runner``) loads only in its workers.
"""

from __future__ import annotations

from typing import Any, Mapping

from workers import prompt as P
from workers.image_header import declared_pixels, decode_ms
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
    prepare_ms=decode_ms,  # the decode and resize, by the pixels its header gives
    ref_bound=declared_pixels,  # and a ref's blob may not grow more pixels before the worker reads it
    ttl_setting="ttl_image_s",
    grounding=_grounding,
    prompt_part=_prompt_part,
)
