"""TextEncoder's contract with a fake engine: one output per input, errors per item."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.text import EncoderOutputError, TextEncoder, TextPreprocessor

DIM = 8


class FakeEngine:
    """Embeds by token ids; fails any batch that contains ``poison_id``."""

    input_names = ("input_ids", "attention_mask")

    def __init__(self, poison_id: int | None = None, drop_last_row: bool = False) -> None:
        self.poison_id = poison_id
        self.drop_last_row = drop_last_row
        self.batch_sizes: list[int] = []

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        self.batch_sizes.append(len(ids))
        if self.poison_id is not None and (ids == self.poison_id).any():
            raise ValueError("poisoned batch")
        # A deterministic per-row vector that depends only on the row's real tokens.
        rows = np.zeros((len(ids), DIM), dtype=np.float32)
        for i, (row, m) in enumerate(zip(ids, mask)):
            for pos, tok in enumerate(row[m.astype(bool)]):
                rows[i, (tok + pos) % DIM] += 1.0
        rows /= np.linalg.norm(rows, axis=1, keepdims=True)
        if self.drop_last_row:
            rows = rows[:-1]
        return {"embedding": rows}


@pytest.fixture(scope="module")
def pre(minilm_tokenizer_json: Path) -> TextPreprocessor:
    return TextPreprocessor(minilm_tokenizer_json, max_length=32)


def poison_id(pre: TextPreprocessor) -> int:
    return int(pre.tokenize_batch(["poison"])["input_ids"][0, 1])


def test_one_unit_vector_per_text_in_order(pre: TextPreprocessor) -> None:
    encoder = TextEncoder(FakeEngine(), pre, embedding_dim=DIM)
    texts = ["alpha", "beta gamma", "delta epsilon zeta"]
    out = encoder.embed(texts)
    assert len(out) == 3
    for text, emb in zip(texts, out):
        assert emb.shape == (DIM,) and emb.dtype == np.float32
        assert np.isclose(np.linalg.norm(emb), 1.0)
        np.testing.assert_array_equal(emb, encoder.embed([text])[0])
    assert encoder.embed([]) == []


def test_texts_are_normalized_before_tokenizing(pre: TextPreprocessor) -> None:
    encoder = TextEncoder(FakeEngine(), pre, embedding_dim=DIM)
    a, b = encoder.embed(["cafe\u0301  au\nlait", "caf\u00e9 au lait"])
    np.testing.assert_array_equal(a, b)


def test_wrong_output_count_is_an_error(pre: TextPreprocessor) -> None:
    encoder = TextEncoder(FakeEngine(drop_last_row=True), pre, embedding_dim=DIM)
    with pytest.raises(EncoderOutputError, match="for 2 texts"):
        encoder.embed(["a", "b"])


def test_run_batch_isolates_the_failing_item(pre: TextPreprocessor) -> None:
    engine = FakeEngine(poison_id=poison_id(pre))
    encoder = TextEncoder(engine, pre, embedding_dim=DIM)
    results = encoder.run_batch(["fine", "poison pill", "also fine"])
    assert len(results) == 3
    assert isinstance(results[1], ValueError)
    healthy = TextEncoder(FakeEngine(), pre, embedding_dim=DIM)
    np.testing.assert_array_equal(results[0], healthy.embed(["fine"])[0])
    np.testing.assert_array_equal(results[2], healthy.embed(["also fine"])[0])
    assert engine.batch_sizes == [3, 1, 1, 1]  # the batch, then one retry per item


def test_run_batch_rejects_non_strings_without_failing_the_batch(pre: TextPreprocessor) -> None:
    engine = FakeEngine()
    encoder = TextEncoder(engine, pre, embedding_dim=DIM)
    results = encoder.run_batch(["fine", None, b"bytes", "ok"])
    assert isinstance(results[1], TypeError) and isinstance(results[2], TypeError)
    assert all(isinstance(r, np.ndarray) for r in (results[0], results[3]))
    assert engine.batch_sizes == [2]  # one engine call for the valid texts, no retries


def test_run_batch_single_failure_is_not_retried(pre: TextPreprocessor) -> None:
    engine = FakeEngine(poison_id=poison_id(pre))
    results = TextEncoder(engine, pre, embedding_dim=DIM).run_batch(["poison"])
    assert isinstance(results[0], ValueError)
    assert engine.batch_sizes == [1]


def test_run_batch_of_nothing(pre: TextPreprocessor) -> None:
    engine = FakeEngine()
    assert TextEncoder(engine, pre, embedding_dim=DIM).run_batch([]) == []
    assert engine.batch_sizes == []


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["fine", "poison", "ok then", None, "a b c d e"]), max_size=12))
def test_run_batch_one_result_per_input_always(minilm_tokenizer_json: Path, texts: list) -> None:
    pre = TextPreprocessor(minilm_tokenizer_json, max_length=32)
    encoder = TextEncoder(FakeEngine(poison_id=poison_id(pre)), pre, embedding_dim=DIM)
    results = encoder.run_batch(texts)
    assert len(results) == len(texts)
    for text, result in zip(texts, results):
        if text is None or text == "poison":
            assert isinstance(result, Exception)
        else:
            assert isinstance(result, np.ndarray) and result.shape == (DIM,)
