"""The image modality's compute, loaded only where an ``encode.image`` worker (or the generic
pool) starts: decoding, resizing and the classifier engine (``workers/image.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import image
from workers.encoders import Runner, load_engine, run_isolated, timed
from workers.image import ImageEncoder, _warmup_image, load_labels, model_input, normalized_pixels, preprocess
from workers.modalities.image import SPEC
from workers.offload import Offload, OffloadDied
from workers.outputs import Encoded, Observer, Prepared
from workers.video import FRAMES_MIME, frames_from_bytes

PREPROCESSING = f"{image.PREPROCESSING_VERSION}+pixels+{FRAMES_MIME}"
"""In the reuse cache's key: photos by their pixels, frame chunks as raw frames."""


def image_runner(settings: Settings, observer: Observer, stage: str) -> tuple[Runner, ImageEncoder]:
    """The image pool's runner (photos and video frame chunks) and the ImageEncoder itself."""
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage)
    encoder = ImageEncoder(engine, load_labels(config.directory / "labels.json"),
                           max_pixels=settings.limits.max_image_pixels)
    encoder.warmup()

    def prepare(job: EncodeJob) -> Prepared:
        if job.mime == FRAMES_MIME:  # a video's frame chunk: raw frames already, one unit each
            frames = preprocess(frames_from_bytes(job.data or b""))
            return Prepared(job, float(len(frames)), frames, content=job.data)
        pixels, content = model_input(job.data or b"", job.mime, pixel_bound(job, settings))
        return Prepared(job, 1.0, pixels, content=content)

    # Started at the first heavy picture (a spawn is ~0.5 s), so a runner that never sees one
    # (the router's, the bench's in-process server) has no process more.
    offload = Offload(settings.encoder.heavy_prep_nice) if settings.encoder.heavy_prep_process else None

    def prepare_heavy(job: EncodeJob) -> Prepared:
        """A picture priced as heavy, decoded in the offload process (``workers.offload``)."""
        if offload is None or job.mime == FRAMES_MIME:
            return prepare(job)
        try:
            pixels, content = offload.call(model_input, job.data or b"", job.mime, pixel_bound(job, settings))
        except OffloadDied as exc:
            raise WireError(ErrorCode.INTERNAL, f"the image was not decoded: {exc}") from None
        return Prepared(job, 1.0, pixels, content=content)

    def run_together(items: list[Prepared]) -> list[Any]:
        """One engine call for every photo and frame of the batch, split back per item."""
        outputs = encoder.encode_pixels(np.concatenate([item.data for item in items]))
        out, at = [], 0
        for item in items:
            mine, at = outputs[at:at + len(item.data)], at + len(item.data)
            if item.job.mime == FRAMES_MIME:  # the SUM of the frames' embeddings: the assembler pools
                out.append(Encoded(np.sum([o.embedding for o in mine], axis=0),
                                   {"frames": len(mine), "labels": [o.top5[0][0] for o in mine],
                                    "top": [[[label, round(p, 4)] for label, p in o.top5[:3]] for o in mine]}))
            else:
                out.append(Encoded(mine[0].embedding, {"top5": [[label, round(p, 5)] for label, p in mine[0].top5]}))
        return out

    def run(items: list[Prepared]) -> list[Any]:
        return run_isolated(items, run_together)

    def calibrate() -> list[tuple[int, float, float]]:
        pixels = preprocess([_warmup_image(seed) for seed in range(8)])
        rows = []
        for n in (1, 2, 4, 8):
            encoder.encode_pixels(pixels[:n])
            rows.append((n, 1.0, min(timed(lambda: encoder.encode_pixels(pixels[:n])) for _ in range(2))))
        return rows

    identity = f"{config.name}/{config.version}/{engine.precision}/{image.PREPROCESSING_VERSION}"
    return Runner(prepare, run, calibrate, identity, cost_prior=(1.0, 8.0, 0.0), config=config,
                  precision=engine.precision, cache_content=cache_content, preprocessing=PREPROCESSING,
                  prepare_heavy=prepare_heavy), encoder


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    return image_runner(settings, observer, stage)[0]


def cache_content(job: EncodeJob, settings: Settings) -> bytes | None:
    # Photos by the pixels the model sees (the same picture hits however it was encoded);
    # frame chunks are raw pixels already.
    if job.data is None or job.mime == FRAMES_MIME:
        return job.data
    return normalized_pixels(job.data, job.mime, pixel_bound(job, settings))


def pixel_bound(job: EncodeJob, settings: Settings) -> int:
    """The most pixels the job's image may have: the deployment's bound, and for a ref the
    pixels its header declared when the router priced it."""
    bound = settings.limits.max_image_pixels
    return bound if job.ref_pixels is None else min(bound, job.ref_pixels)
