"""preprocess and ImageEncoder with a hand-built engine: shapes, ranges, per-item errors."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from schemas.errors import ErrorCode, WireError
from workers.image import ImageEncoder, ImageOutput, load_labels, preprocess
from workers.text import EncoderOutputError

LABELS = tuple(f"class {i}" for i in range(10))


def png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


class FakeEngine:
    """Embedding = per-channel means (padded), logits favour class (mean brightness bucket).

    ``fail_batches_over`` makes a call with more rows fail, like a batch that is too big.
    """

    def __init__(self, dim: int = 8, classes: int = len(LABELS), fail_batches_over: int | None = None) -> None:
        self.dim, self.classes, self.fail_batches_over = dim, classes, fail_batches_over
        self.batch_sizes: list[int] = []

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("pixels",)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feeds["pixels"]
        self.batch_sizes.append(len(x))
        if self.fail_batches_over is not None and len(x) > self.fail_batches_over:
            raise RuntimeError("batch too large for the device")
        emb = np.zeros((len(x), self.dim), dtype=np.float32)
        emb[:, :3] = x.mean(axis=(2, 3)) + 2.0
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        logits = np.zeros((len(x), self.classes), dtype=np.float32)
        logits[np.arange(len(x)), np.clip(((x.mean(axis=(1, 2, 3)) + 1) * 5).astype(int), 0, self.classes - 1)] = 5.0
        return {"embedding": emb, "logits": logits}


def encoder(engine: FakeEngine | None = None, max_pixels: int = 1_000_000) -> ImageEncoder:
    return ImageEncoder(engine or FakeEngine(), LABELS, max_pixels=max_pixels, embedding_dim=8)


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 700), height=st.integers(1, 700), mode=st.sampled_from(["RGB", "L", "RGBA"]))
def test_preprocess_gives_the_model_shape_and_range(width: int, height: int, mode: str) -> None:
    image = Image.fromarray(np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8))
    batch = preprocess([image.convert(mode)])
    assert batch.shape == (1, 3, 224, 224) and batch.dtype == np.float32
    assert batch.min() >= -1.0 and batch.max() <= 1.0


def test_preprocess_maps_black_and_white_to_the_ends_of_the_range() -> None:
    batch = preprocess([Image.new("RGB", (300, 256), (0, 0, 0)), Image.new("RGB", (256, 300), (255, 255, 255))])
    assert batch.shape == (2, 3, 224, 224)
    assert np.all(batch[0] == -1.0) and np.allclose(batch[1], 1.0)


def test_preprocess_takes_the_centre_and_keeps_channel_order() -> None:
    # Left third red, middle third green, right third blue: the centre crop is green.
    stripes = np.zeros((256, 768, 3), dtype=np.uint8)
    stripes[:, :256, 0] = stripes[:, 256:512, 1] = stripes[:, 512:, 2] = 255
    batch = preprocess([Image.fromarray(stripes)])
    assert np.allclose(batch[0, :, 112, 112], [-1.0, 1.0, -1.0])


def test_preprocess_of_nothing_is_an_empty_batch() -> None:
    assert preprocess([]).shape == (0, 3, 224, 224)


def test_preprocess_is_deterministic_across_threads() -> None:
    images = [Image.open(io.BytesIO(png(400 + i, 300, seed=i))).convert("RGB") for i in range(8)]
    alone = [preprocess([im]) for im in images]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda im: preprocess([im]), images * 3))
    for i, result in enumerate(threaded):
        assert np.array_equal(result, alone[i % len(images)])


def test_run_batch_returns_one_output_per_image() -> None:
    results = encoder().run_batch([(png(300, 200, seed=i), "image/png") for i in range(3)])
    assert len(results) == 3 and all(isinstance(r, ImageOutput) for r in results)
    for r in results:
        assert r.embedding.shape == (8,) and r.embedding.dtype == np.float32
        assert np.isclose(np.linalg.norm(r.embedding), 1.0)
        assert len(r.top5) == 5 and all(label in LABELS for label, _ in r.top5)
        probs = [p for _, p in r.top5]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-6


def test_one_broken_image_never_fails_the_others() -> None:
    engine = FakeEngine()
    results = encoder(engine, max_pixels=100_000).run_batch(
        [
            (png(300, 200), "image/png"),
            (b"definitely not an image", "image/png"),
            (png(400, 400), "image/png"),  # 160,000 pixels > the limit
            (png(300, 200, seed=1), "image/gif"),
            ("text", None),  # type: ignore[list-item]
            (png(200, 300, seed=2), None),
        ]
    )
    assert isinstance(results[0], ImageOutput) and isinstance(results[5], ImageOutput)
    assert isinstance(results[1], WireError) and results[1].code is ErrorCode.UNSUPPORTED_MEDIA
    assert isinstance(results[2], WireError) and results[2].code is ErrorCode.PAYLOAD_TOO_LARGE
    assert isinstance(results[3], WireError) and results[3].code is ErrorCode.UNSUPPORTED_MEDIA
    assert isinstance(results[4], TypeError)
    assert engine.batch_sizes == [2]  # the good ones still share one engine call


def test_a_failed_batch_is_retried_one_by_one() -> None:
    engine = FakeEngine(fail_batches_over=1)
    results = encoder(engine).run_batch([(png(300, 200, seed=i), None) for i in range(3)])
    assert all(isinstance(r, ImageOutput) for r in results)
    assert engine.batch_sizes == [3, 1, 1, 1]


def test_batch_results_match_single_results() -> None:
    datas = [(png(300 + 50 * i, 200, seed=i), None) for i in range(4)]
    batched = encoder().run_batch(datas)
    for data, result in zip(datas, batched):
        alone = encoder().run_batch([data])[0]
        assert np.array_equal(alone.embedding, result.embedding) and alone.top5 == result.top5


def test_wrong_output_shape_is_reported_per_item() -> None:
    results = ImageEncoder(FakeEngine(dim=4), LABELS, embedding_dim=8).run_batch([(png(300, 200), None)])
    assert isinstance(results[0], EncoderOutputError)


def test_empty_batch_makes_no_engine_call() -> None:
    engine = FakeEngine()
    assert encoder(engine).run_batch([]) == [] and engine.batch_sizes == []


def test_warmup_runs_batch_one_and_four() -> None:
    engine = FakeEngine()
    encoder(engine).warmup(n=2)
    assert engine.batch_sizes == [1, 4, 1, 4]


def test_load_labels(tmp_path: Path) -> None:
    good = tmp_path / "labels.json"
    good.write_text(json.dumps(list(LABELS)))
    assert load_labels(good) == LABELS
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"0": "tench"}))
    with pytest.raises(ValueError, match="list of class names"):
        load_labels(bad)
