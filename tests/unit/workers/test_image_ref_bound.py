"""An image ref is decoded no larger than its header declared when the router priced it
(``EncodeJob.ref_pixels``): a claim check overwritten since with a bigger picture of the same
bytes is refused, not decoded at the old price."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from schemas.errors import WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers.image import model_input
from workers.modalities.image_runner import pixel_bound


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return out.getvalue()


def job(ref_pixels: int | None) -> EncodeJob:
    return EncodeJob(id="r", part=0, n_parts=1, modality="image", lane="rt", tenant="t", deadline_at_ms=0.0,
                     sent_at_ms=0.0, data=b"", mime="image/png", ref_pixels=ref_pixels)


def test_a_ref_swapped_for_a_bigger_picture_is_refused_and_the_priced_one_decodes() -> None:
    settings = Settings.from_env({})
    priced = job(ref_pixels=300 * 200)
    model_input(png(300, 200), "image/png", pixel_bound(priced, settings))  # what was priced: decoded
    swapped = png(3000, 2000)  # a flat picture: hardly more bytes, 100 times the pixels
    with pytest.raises(WireError) as refused:
        model_input(swapped, "image/png", pixel_bound(priced, settings))
    assert refused.value.code == "payload_too_large"
    model_input(swapped, "image/png", pixel_bound(job(ref_pixels=None), settings))  # inline: the deployment's bound
    assert pixel_bound(job(ref_pixels=10**12), settings) == settings.limits.max_image_pixels
