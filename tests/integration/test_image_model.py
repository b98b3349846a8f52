"""The real EfficientNet-Lite0 export: right classes on real photos, int8 agrees, batches are inert.

Needs no broker: it builds the model into the machine's model repository (once per
machine; later runs find it up to date) and runs it on the CPU. Skips when the build
dependencies (torch, the model packages, scikit-image) are absent.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("skimage")

from schemas.errors import ErrorCode, WireError  # noqa: E402
from schemas.settings import Settings  # noqa: E402
from workers.engines.gate import check_variant  # noqa: E402
from workers.engines.onnx import OnnxEngine  # noqa: E402
from workers.image import ImageEncoder, ImageOutput, load_labels  # noqa: E402
from workers.models.build import build_models, ensure_built  # noqa: E402
from workers.models.efficientnet import NAME, sample_photo  # noqa: E402
from workers.models.fidelity import cosine_rows  # noqa: E402
from workers.repository import ModelConfig  # noqa: E402

CATS = ("tabby", "tiger cat", "Egyptian cat")
COFFEE_WORDS = ("cup", "espresso", "coffee")


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    root = Settings.from_env().models.repository
    return ensure_built(root, NAME, log=lambda line: print(line))


@pytest.fixture(scope="module")
def encoders(config: ModelConfig) -> dict[str, ImageEncoder]:
    labels = load_labels(config.tokenizer_path)
    out = {}
    for precision in ("fp32", "int8"):
        engine = OnnxEngine(config, precision, intra_op_threads=2, providers=("CPUExecutionProvider",))
        engine.load()
        out[precision] = ImageEncoder(engine, labels, embedding_dim=config.embedding_dim)
        out[precision].warmup(n=1)
    return out


def jpeg(name: str, quality: int = 92) -> tuple[bytes, str]:
    out = io.BytesIO()
    sample_photo(name).save(out, "JPEG", quality=quality)
    return out.getvalue(), "image/jpeg"


def png(name: str) -> tuple[bytes, str]:
    out = io.BytesIO()
    sample_photo(name).save(out, "PNG")
    return out.getvalue(), "image/png"


def only(results: list) -> list[ImageOutput]:
    for r in results:
        if not isinstance(r, ImageOutput):
            raise AssertionError(f"expected an output, got {r!r}")
    return results


def test_labels_are_the_thousand_imagenet_classes(config: ModelConfig) -> None:
    labels = load_labels(config.tokenizer_path)
    assert len(labels) == 1000 and labels[0].startswith("tench") and labels[281].startswith("tabby")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_chelsea_is_a_cat_and_coffee_is_coffee(encoders, precision: str) -> None:
    chelsea, coffee = only(encoders[precision].run_batch([png("chelsea"), jpeg("coffee")]))
    print(f"{precision}: chelsea {chelsea.top5[:3]}, coffee {coffee.top5[:3]}")
    assert chelsea.top5[0][0].split(",")[0] in CATS
    assert any(word in coffee.top5[0][0] for word in COFFEE_WORDS)
    assert len(chelsea.top5) == 5 and chelsea.top5[0][1] > chelsea.top5[4][1]


def test_int8_agrees_with_fp32_on_the_sample_photos(config: ModelConfig, encoders) -> None:
    datas = [png("chelsea"), jpeg("coffee"), png("astronaut"), jpeg("rocket")]
    fp32 = only(encoders["fp32"].run_batch(datas))
    int8 = only(encoders["int8"].run_batch(datas))
    assert [o.top5[0][0] for o in int8[:2]] == [o.top5[0][0] for o in fp32[:2]]
    cos = cosine_rows(np.array([o.embedding for o in int8]), np.array([o.embedding for o in fp32]))
    recorded = config.variant("int8").fidelity
    print(f"int8 vs fp32 cosine {np.round(cos, 4)}; config.json: {dict(recorded)}")
    assert cos.min() >= 0.97
    # What the build measured passes the gate the encoder applies at load, on this CPU: a
    # recipe whose int8 falls short on it (u8s8 saturation without VNNI) is served as fp32.
    assert check_variant(config, "int8") is None, recorded
    assert recorded["top1_agreement"] >= 0.9


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_image_gets_the_same_answer_alone_and_in_a_batch(encoders, precision: str) -> None:
    datas = [png("chelsea"), jpeg("coffee"), png("astronaut"), jpeg("rocket"), jpeg("chelsea", 40)]
    batched = only(encoders[precision].run_batch(datas))
    alone = [only(encoders[precision].run_batch([d]))[0] for d in datas]
    cos = cosine_rows(np.array([o.embedding for o in batched]), np.array([o.embedding for o in alone]))
    print(f"{precision} batched vs alone: min cosine {cos.min():.8f}")
    # Static int8 has constant scales, so it is as batch-independent as fp32.
    assert cos.min() >= 0.9999
    assert [o.top5[0][0] for o in batched] == [o.top5[0][0] for o in alone]


def test_embeddings_are_unit_length_and_separate_subjects(encoders) -> None:
    cat, cat_small, coffee = only(encoders["fp32"].run_batch([png("chelsea"), jpeg("chelsea", 30), jpeg("coffee")]))
    assert np.isclose(np.linalg.norm(cat.embedding), 1.0, atol=1e-5)
    assert float(cat.embedding @ cat_small.embedding) > float(cat.embedding @ coffee.embedding) + 0.2


def test_a_broken_image_in_a_real_batch_fails_alone(encoders) -> None:
    data, mime = jpeg("coffee")
    results = encoders["fp32"].run_batch([png("chelsea"), (data[: len(data) // 3], mime), (data, mime)])
    assert isinstance(results[0], ImageOutput) and isinstance(results[2], ImageOutput)
    assert isinstance(results[1], WireError) and results[1].code is ErrorCode.UNSUPPORTED_MEDIA


def test_fidelity_is_recorded_in_config_json(config: ModelConfig) -> None:
    fp32, int8 = config.variant("fp32").fidelity, config.variant("int8").fidelity
    assert fp32["reference"] == "torch" and fp32["max_abs_diff"] < 1e-4 and fp32["top1_agreement"] == 1.0
    assert int8["reference"] == "fp32" and int8["batch_vs_alone_min_cosine"] >= 0.9999
    assert "static" in int8["quantization"]
    assert [t.name for t in config.outputs] == ["embedding", "logits"]


def test_rebuild_is_skipped_when_up_to_date(config: ModelConfig) -> None:
    start = time.monotonic()
    report = build_models(config.directory.parent.parent, [NAME], log=lambda _: None)[0]
    assert report.status == "up to date"
    assert time.monotonic() - start < 2.0


def test_a_heavy_picture_is_decoded_in_the_offload_process_as_it_would_be_here(config: ModelConfig) -> None:
    import multiprocessing

    from schemas.jobs import EncodeJob
    from workers.modalities.image_runner import image_runner

    class Quiet:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    def job(data: bytes, mime: str) -> EncodeJob:
        return EncodeJob(id="h", part=0, n_parts=1, modality="image", lane="rt", tenant="t", deadline_at_ms=0.0,
                         sent_at_ms=0.0, data=data, mime=mime)

    runner, _ = image_runner(Settings.from_env(), Quiet(), "encode.image")
    assert runner.prepare_heavy is not None
    before = {p.pid for p in multiprocessing.active_children()}
    here = runner.prepare(job(*png("chelsea")))
    assert {p.pid for p in multiprocessing.active_children()} == before  # a light decode: here
    there = runner.prepare_heavy(job(*png("chelsea")))
    assert {p.pid for p in multiprocessing.active_children()} - before  # the heavy one: in a process of its own
    assert np.array_equal(here.data, there.data) and here.content == there.content
    with pytest.raises(WireError) as refused:  # an error in the process comes back as itself
        runner.prepare_heavy(job(b"\x89PNG junk", "image/png"))
    assert refused.value.code == ErrorCode.UNSUPPORTED_MEDIA
