"""normalize() and TextPreprocessor with the real MiniLM tokenizer.json."""

from __future__ import annotations

import functools
from typing import Any

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.text import TextPreprocessor, normalize


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("  hello   world \n", "hello world"),
        ("tabs\tand\nnewlines\r\nand\u00a0nbsp", "tabs and newlines and nbsp"),
        ("cafe\u0301", "caf\u00e9"),  # decomposed accent -> composed (NFC)
        ("Case And Punctuation!", "Case And Punctuation!"),  # left to the tokenizer
        ("   ", ""),
    ],
)
def test_normalize(raw: str, expected: str) -> None:
    assert normalize(raw) == expected


@given(st.text())
def test_normalize_is_idempotent(text: str) -> None:
    once = normalize(text)
    assert normalize(once) == once
    assert once == once.strip() and "  " not in once


@pytest.fixture(scope="module")
def pre(minilm_tokenizer_json: Path) -> TextPreprocessor:
    return TextPreprocessor(minilm_tokenizer_json, max_length=32)


def test_pads_to_the_longest_of_the_batch_not_to_128(pre: TextPreprocessor) -> None:
    feeds = pre.tokenize_batch(["hi", "a somewhat longer sentence here"])
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    assert set(feeds) == {"input_ids", "attention_mask"}
    assert ids.dtype == mask.dtype == np.int64
    longest = len(pre.ids("a somewhat longer sentence here"))
    assert ids.shape == mask.shape == (2, longest)
    assert mask[1].all()
    short = len(pre.ids("hi"))
    assert short == 3  # [CLS] hi [SEP]
    assert mask[0].tolist() == [1] * short + [0] * (longest - short)
    assert (ids[0, short:] == 0).all()  # [PAD] is id 0
    assert ids[0, 0] == 101 and ids[0, short - 1] == 102  # [CLS] ... [SEP]


def test_a_batch_row_equals_the_text_tokenized_alone(pre: TextPreprocessor) -> None:
    texts = ["one", "two words", "and now three words"]
    batch = pre.tokenize_batch(texts)
    for i, text in enumerate(texts):
        alone = pre.tokenize_batch([text])["input_ids"][0]
        assert batch["input_ids"][i, : len(alone)].tolist() == alone.tolist()


def test_truncates_at_max_length_keeping_the_final_sep(pre: TextPreprocessor) -> None:
    long_text = "word " * 100
    feeds = pre.tokenize_batch([long_text, "short"])
    assert feeds["input_ids"].shape == (2, 32)
    assert feeds["input_ids"][0, -1] == 102
    assert len(pre.ids(long_text)) == 32


def test_lowercasing_is_the_tokenizers(pre: TextPreprocessor) -> None:
    upper = pre.tokenize_batch(["Hello World"])["input_ids"]
    lower = pre.tokenize_batch(["hello world"])["input_ids"]
    assert upper.tolist() == lower.tolist()


def test_empty_batch_and_bad_max_length(minilm_tokenizer_json: Path, pre: TextPreprocessor) -> None:
    with pytest.raises(ValueError):
        pre.tokenize_batch([])
    with pytest.raises(ValueError):
        TextPreprocessor(minilm_tokenizer_json, max_length=1)


WORDS = st.sampled_from(["the", "cat", "sat", "on", "unbelievable", "mat", ",", "!", "x" * 120, "naïve", "日本語",
                         "tokenization", "a", "hyper-parameter", "a-b-c", ",.", "語"])


@functools.lru_cache(maxsize=None)
def _prefix_and_whole(path: Path) -> tuple[TextPreprocessor, Any]:
    """The preprocessor under test and the tokenizer tokenizing whole texts (loaded once)."""
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(path))
    whole.no_padding()
    whole.enable_truncation(max_length=32)
    return TextPreprocessor(path, max_length=32), whole


@settings(deadline=None)  # correctness, not speed: the box may be busy
@given(st.lists(WORDS, min_size=0, max_size=400))
def test_a_long_text_without_spaces_tokenized_from_its_prefix_gives_the_ids_of_the_whole(
        minilm_tokenizer_json: Path, words: list[str]) -> None:
    pre, whole = _prefix_and_whole(minilm_tokenizer_json)
    text = "".join(words)
    assert pre.ids(text) == whole.encode(text, add_special_tokens=True).ids


@settings(deadline=None)
@given(st.lists(WORDS, min_size=0, max_size=400))
def test_a_long_text_tokenized_from_its_prefix_gives_the_ids_of_the_whole(minilm_tokenizer_json: Path,
                                                                          words: list[str]) -> None:
    pre, whole = _prefix_and_whole(minilm_tokenizer_json)
    text = normalize(" ".join(words))
    assert pre.ids(text) == whole.encode(text, add_special_tokens=True).ids


def test_a_64_kib_text_is_not_tokenized_whole(minilm_tokenizer_json: Path, monkeypatch) -> None:
    pre = TextPreprocessor(minilm_tokenizer_json, max_length=256)
    seen: list[int] = []
    real = pre._tokenizer.encode
    monkeypatch.setattr(pre, "_tokenizer", type("T", (), {"encode": lambda self, t, **kw: seen.append(len(t)) or real(t, **kw)})())
    for text in ("word " * 13_000, ",." * 32_768, "日本語" * 7_000, "a-b" * 21_000):
        seen.clear()
        assert len(pre.ids(text)) == 256 and max(seen) <= 256 * 8, text[:10]
