"""The real all-MiniLM-L6-v2 export: ONNX matches torch, int8 stays close, padding is inert.

Needs no broker: it builds the model into the machine's model repository (once per
machine; later runs find it up to date) and runs it on the CPU. Skips when the build
dependencies (torch, transformers, the model package) are absent.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from schemas.settings import Settings
from workers.engines.onnx import OnnxEngine
from workers.models.build import build_models, ensure_built
from workers.models.fidelity import FIDELITY_SENTENCES, cosine_rows
from workers.models.minilm import NAME, package_dir
from workers.repository import ModelConfig
from workers.text import TextEncoder, TextPreprocessor, normalize

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    root = Settings.from_env().models.repository
    return ensure_built(root, NAME, log=lambda line: print(line))


@pytest.fixture(scope="module")
def pre(config: ModelConfig) -> TextPreprocessor:
    return TextPreprocessor(config.tokenizer_path, config.max_length)


@pytest.fixture(scope="module")
def encoders(config: ModelConfig, pre: TextPreprocessor) -> dict[str, TextEncoder]:
    out = {}
    for precision in ("fp32", "int8"):
        engine = OnnxEngine(config, precision, intra_op_threads=2, providers=("CPUExecutionProvider",))
        engine.load()
        out[precision] = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
        out[precision].warmup(n=1)
    return out


def torch_reference(texts: list[str], max_length: int) -> np.ndarray:
    """sentence-transformers' recipe written out independently: each text alone, no padding."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(package_dir(), local_files_only=True)
    model = AutoModel.from_pretrained(package_dir(), local_files_only=True).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            enc = tokenizer(normalize(text), return_tensors="pt", truncation=True, max_length=max_length)
            hidden = model(**enc).last_hidden_state[0]
            mean = hidden.mean(dim=0).numpy().astype(np.float64)
            rows.append(mean / np.linalg.norm(mean))
    return np.array(rows)


def test_fp32_matches_the_torch_sentence_reference(config, encoders) -> None:
    texts = list(FIDELITY_SENTENCES) + ["word " * 300]  # the last one is truncated to max_length
    onnx_rows = np.array(encoders["fp32"].embed(texts))
    cos = cosine_rows(onnx_rows, torch_reference(texts, config.max_length))
    print(f"fp32 vs torch: min cosine {cos.min():.8f}")
    assert cos.min() >= 0.9999
    assert np.allclose(np.linalg.norm(onnx_rows, axis=1), 1.0, atol=1e-5)


def test_int8_stays_close_to_fp32(config, encoders) -> None:
    texts = list(FIDELITY_SENTENCES)
    cos = cosine_rows(np.array(encoders["int8"].embed(texts)), np.array(encoders["fp32"].embed(texts)))
    recorded = config.variant("int8").fidelity
    print(f"int8 vs fp32: mean {cos.mean():.5f} min {cos.min():.5f} (config.json: {dict(recorded)})")
    assert cos.mean() >= 0.98
    assert cos.mean() == pytest.approx(recorded["mean_cosine"], abs=1e-4)


def test_padding_to_the_longest_changes_nothing_in_fp32(encoders) -> None:
    texts = ["hi", "A cat.", FIDELITY_SENTENCES[27], FIDELITY_SENTENCES[29], "lol ok see u tmrw"]
    batched = np.array(encoders["fp32"].embed(texts))
    alone = np.array([encoders["fp32"].embed([t])[0] for t in texts])
    cos = cosine_rows(batched, alone)
    print(f"fp32 batched vs alone: min cosine {cos.min():.8f}")
    assert cos.min() >= 0.9999


def test_int8_depends_on_batch_mates_within_the_recorded_bound(config, encoders) -> None:
    # Dynamic quantization scales activations per call, not per row: a text's int8
    # embedding moves with its batch-mates and their padding. Bounded, and recorded in
    # config.json, but not zero; this pins the size so a change in it is noticed.
    texts = ["hi", "A cat.", FIDELITY_SENTENCES[27], FIDELITY_SENTENCES[29], "lol ok see u tmrw"]
    batched = np.array(encoders["int8"].embed(texts))
    alone = np.array([encoders["int8"].embed([t])[0] for t in texts])
    cos = cosine_rows(batched, alone)
    recorded = config.variant("int8").fidelity["batch_vs_alone_min_cosine"]
    print(f"int8 batched vs alone: min cosine {cos.min():.6f} (recorded on the fidelity set: {recorded})")
    assert cos.min() >= 0.97 and recorded >= 0.97


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_similar_sentences_are_closer_than_unrelated(encoders, precision: str) -> None:
    q, a, unrelated = encoders[precision].embed(
        [
            "What is the capital of Australia?",
            "Canberra is the capital city of Australia.",
            "Stir the sauce continuously over low heat until it thickens.",
        ]
    )
    assert float(q @ a) > float(q @ unrelated) + 0.2
    dog, puppy, car = encoders[precision].embed(
        ["A dog runs in the park.", "A puppy is playing on the grass outside.", "The stock market fell sharply."]
    )
    assert float(dog @ puppy) > float(dog @ car)


def test_rebuild_is_skipped_when_up_to_date(config) -> None:
    start = time.monotonic()
    report = build_models(config.directory.parent.parent, [NAME], log=lambda _: None)[0]
    assert report.status == "up to date"
    assert time.monotonic() - start < 2.0
