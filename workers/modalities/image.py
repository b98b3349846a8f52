"""The image modality: an ImageNet classifier's embedding and top labels (``workers/image.py``).

The image pool also encodes video frame chunks (``FRAMES_MIME``, from the video stage):
their output is the SUM of the frames' embeddings, which the assembler pools. One image or
frame is one unit of cost (every picture is resized to 224x224 before the engine).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import image
from workers import prompt as P
from workers.encoders import Runner, load_engine, refs_not_served, timed
from workers.image import ImageEncoder, _warmup_image, load_labels, normalized_pixels
from workers.modalities.spec import ModalitySpec
from workers.outputs import Encoded, Observer
from workers.video import FRAME_BYTES, FRAMES_MIME, frames_from_bytes


def image_runner(settings: Settings, observer: Observer, stage: str) -> tuple[Runner, ImageEncoder]:
    """The image pool's runner (photos and video frame chunks) and the ImageEncoder itself."""
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage)
    encoder = ImageEncoder(engine, load_labels(config.directory / "labels.json"),
                           max_pixels=settings.limits.max_image_pixels)
    encoder.warmup()

    def frame_chunk(job: EncodeJob) -> Any:
        """A video's frame chunk: the SUM of its frames' embeddings (the assembler pools)."""
        try:
            outputs = encoder.encode(frames_from_bytes(job.data or b""))
        except Exception as exc:
            return exc
        return Encoded(np.sum([o.embedding for o in outputs], axis=0),
                       {"frames": len(outputs), "labels": [o.top5[0][0] for o in outputs],
                        "top": [[[label, round(p, 4)] for label, p in o.top5[:3]] for o in outputs]})

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        photos = [j for j in jobs if j.data is not None and j.mime != FRAMES_MIME]
        results = iter(encoder.run_batch([(j.data, j.mime) for j in photos]))
        out: list[Any] = []
        for j in jobs:
            if j.data is None:
                out.append(refs_not_served(j))
            elif j.mime == FRAMES_MIME:
                out.append(frame_chunk(j))
            else:
                r = next(results)
                out.append(r if isinstance(r, Exception) else
                           Encoded(r.embedding, {"top5": [[label, round(p, 5)] for label, p in r.top5]}))
        return out

    def cost(job: EncodeJob) -> float:
        return max(1.0, len(job.data or b"") / FRAME_BYTES) if job.mime == FRAMES_MIME else 1.0

    def calibrate() -> tuple[float, float]:
        images = [_warmup_image(seed) for seed in range(4)]
        return 4.0, timed(lambda: encoder.encode(images))

    run = SPEC.cached(settings, observer, run_batch, config)
    identity = f"{config.name}/{config.version}/{settings.encoder.precision}/{image.PREPROCESSING_VERSION}"
    return Runner(run, cost, calibrate, identity), encoder


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    return image_runner(settings, observer, stage)[0]


def _content(job: EncodeJob, settings: Settings) -> bytes | None:
    # Photos by the pixels the model sees (the same picture hits however it was encoded);
    # frame chunks are raw pixels already.
    if job.data is None or job.mime == FRAMES_MIME:
        return job.data
    return normalized_pixels(job.data, job.mime, settings.limits.max_image_pixels)


def _labels(pairs: Any) -> list[P.Label]:
    return [P.Label(str(name), float(score)) for name, score in (pairs or [])]


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"labels": extras.get("top5", [])}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.ImagePart(_labels(grounded.get("labels")), failed=bool(grounded.get("failed")))


SPEC = ModalitySpec(
    name="image",
    runner=build_runner,
    model_setting="image_model",
    recipe="efficientnet-lite0",
    cache_content=_content,
    preprocessing=f"{image.PREPROCESSING_VERSION}+pixels+{FRAMES_MIME}",
    cost_unit="image",
    ms_per_unit=8.0,  # per image at 224x224
    units_per_record=1.0,
    ttl_setting="ttl_image_s",
    grounding=_grounding,
    prompt_part=_prompt_part,
)
