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
from workers.encoders import Runner, refs_not_served
from workers.modalities import image, text
from workers.outputs import Encoded, Observer
from workers.video import decode_video

STAGE = "encode.any"


def generic_runner(settings: Settings, observer: Observer) -> Runner:
    text_run = text.build_runner(settings, observer, STAGE)
    image_run, image_encoder = image.image_runner(settings, observer, STAGE)
    v = settings.video

    def video(job: EncodeJob) -> Any:
        try:
            if job.data is None:
                raise refs_not_served(job)
            clip = decode_video(job.data, v.max_seconds, v.max_frames, v.fps)
            outs = image_encoder.encode([Image.fromarray(f) for f in clip.frames])
        except Exception as exc:
            return exc
        pooled = np.mean([o.embedding for o in outs], axis=0)
        pooled /= max(float(np.linalg.norm(pooled)), 1e-12)
        return Encoded(pooled, {"duration_s": round(clip.duration_s, 3), "frames_sampled": len(outs),
                                "frames_encoded": len(outs), "complete": True, "has_audio": clip.has_audio,
                                "frame_labels": [o.top5[0][0] for o in outs]})

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        out: list[Any] = [None] * len(jobs)
        for modality, runner in (("text", text_run.run_batch), ("image", image_run.run_batch)):
            idx = [i for i, j in enumerate(jobs) if j.modality == modality]
            for i, r in zip(idx, runner([jobs[i] for i in idx]) if idx else []):
                out[i] = r
        for i, j in enumerate(jobs):
            if j.modality == "video":
                out[i] = video(j)
            elif out[i] is None:
                out[i] = WireError(ErrorCode.UNSUPPORTED_MEDIA, f"no {j.modality} encoder in the generic pool",
                                   f"parts.{j.part}")
        return out

    # One queue for everything: a job is a job.
    return Runner(run_batch, lambda job: 1.0)
