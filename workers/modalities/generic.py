"""The no-routing baseline's one pool (stage ``encode.any``): not a modality, but every part
of text, image and video on one queue and one batch loop (what makes light text wait
behind video). A video is decoded and its frames encoded right here, not fanned out."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers.encoders import Runner, run_isolated
from workers.modalities import image_runner, text_runner
from workers.outputs import Encoded, Observer, Prepared
from workers.video import decode_video

STAGE = "encode.any"


def generic_runner(settings: Settings, observer: Observer) -> Runner:
    text_run = text_runner.build_runner(settings, observer, STAGE)
    image_run, image_encoder = image_runner.image_runner(settings, observer, STAGE)
    v = settings.video

    def prepare(job: EncodeJob) -> Prepared:
        if job.modality == "text":
            return text_run.prepare(job)
        if job.modality == "image":
            return image_run.prepare(job)
        if job.modality == "video":
            clip = decode_video(job.data or b"", v.max_seconds, v.max_frames, v.fps)
            return Prepared(job, 1.0, clip)
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"no {job.modality} encoder in the generic pool", f"parts.{job.part}")

    def video(item: Prepared) -> Any:
        clip = item.data
        outs = image_encoder.encode([Image.fromarray(f) for f in clip.frames])
        pooled = np.mean([o.embedding for o in outs], axis=0)
        pooled /= max(float(np.linalg.norm(pooled)), 1e-12)
        return Encoded(pooled, {"duration_s": round(clip.duration_s, 3), "frames_sampled": len(outs),
                                "frames_encoded": len(outs), "complete": True, "has_audio": clip.has_audio,
                                "frame_labels": [o.top5[0][0] for o in outs]})

    def run(items: list[Prepared]) -> list[Any]:
        out: list[Any] = [None] * len(items)
        for modality, runner in (("text", text_run.run), ("image", image_run.run)):
            idx = [i for i, item in enumerate(items) if item.job.modality == modality]
            for i, r in zip(idx, runner([items[i] for i in idx]) if idx else []):
                out[i] = r
        for i, item in enumerate(items):
            if item.job.modality == "video":
                out[i] = run_isolated([item], lambda one: [video(one[0])])[0]
        return out

    # One queue for everything, FIFO: a job is a job (what makes text wait behind video).
    return Runner(prepare, run, cost_prior=(1.0, 10.0, 0.0))
