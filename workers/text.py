"""Text preprocessing and the text encoder: strings in, one L2-normalized embedding out each.

The encoder is engine-agnostic: it turns texts into the feeds the model's config names,
runs the engine once per batch and checks that it got exactly one row per text.
"""

from __future__ import annotations

import logging
import unicodedata
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Names what `normalize` and the tokenization settings do. The reuse cache keys on it (with
# the model id and version), so bump it whenever normalize's output or the way texts become
# token ids changes, or cached embeddings would answer for a different input.
PREPROCESSING_VERSION = "text-nfc-ws-v1"

# Sentences of a few lengths for warm-up: ONNX Runtime sizes its buffers on first use of a
# shape, so warming up at several lengths keeps that cost out of the first requests.
_WARMUP_TEXTS = (
    "hello",
    "A short sentence about the weather in the mountains today.",
    "Kafka partitions let several replicas of one stage share the work, while consumer "
    "groups keep each message with exactly one of them; the encoder batches what arrives "
    "within a few milliseconds and pads only to the longest text of the batch.",
)


def normalize(text: str) -> str:
    """The canonical form of ``text`` that is embedded and that the cache keys on.

    Unicode NFC (so composed and decomposed accents are one string), then every run of
    Unicode whitespace (spaces, tabs, newlines, NBSP...) becomes one space, and leading and
    trailing whitespace is dropped. Case and punctuation are kept: folding them is the
    tokenizer's business and differs per model. Deterministic and idempotent.
    """
    return " ".join(unicodedata.normalize("NFC", text).split())


PREFIX_CHARS_PER_TOKEN = 8
"""Characters of a long text tokenized first per token kept (English averages ~4 per token)."""


def _boundary_before(text: str, limit: int, window: int = 256) -> int:
    """A position at most ``limit`` where the pre-tokenizer splits whatever the text around
    it (before a space, a punctuation mark or a CJK character), searched back ``window``
    characters; 0 when the text is short or no such position is near."""
    if len(text) <= limit:
        return 0
    for i in range(limit, max(0, limit - window), -1):
        c = text[i]
        if c.isspace() or unicodedata.category(c).startswith("P") or _cjk(c):
            return i
    return 0


def _cjk(c: str) -> bool:
    o = ord(c)
    return 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2FA1F or 0xF900 <= o <= 0xFAFF


class TextPreprocessor:
    """Tokenizes with a Hugging Face ``tokenizer.json``, padding only to the longest text.

    ``max_length`` counts tokens including the special ones ([CLS], [SEP]); longer inputs
    are truncated. Thread-safe once built (the tokenizer is only configured here).
    """

    def __init__(self, tokenizer_json_path: Path, max_length: int) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must leave room for the special tokens, got {max_length}")
        self.max_length = max_length
        self._tokenizer = Tokenizer.from_file(str(tokenizer_json_path))
        # tokenizer.json files often pad every input to a fixed length (the MiniLM one to
        # 128); that makes a 10-token text cost as much as a 128-token one. Keep its pad
        # token, drop the fixed length: `length=None` pads to the longest of each batch.
        padding = self._tokenizer.padding or {}
        self._pad_id = int(padding.get("pad_id", 0))
        self._tokenizer.enable_padding(
            pad_id=padding.get("pad_id", 0),
            pad_type_id=padding.get("pad_type_id", 0),
            pad_token=padding.get("pad_token", "[PAD]"),
            length=None,
        )
        self._tokenizer.enable_truncation(max_length=max_length)

    def tokenize_batch(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Token ids of ``texts`` as they are (call ``normalize`` first).

        Returns ``input_ids`` and ``attention_mask``, int64 arrays of shape
        [len(texts), longest], longest <= max_length; padded positions have mask 0.
        Raises ``ValueError`` on an empty batch and ``TypeError`` on a non-str item.
        """
        if not texts:
            raise ValueError("empty batch")
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=True)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        }

    def ids(self, text: str) -> list[int]:
        """Token ids of one text as it is (call ``normalize`` first): special tokens
        included, truncation applied, no padding.

        A long text is tokenized from a prefix cut at a space that already gives the
        ``max_length`` tokens kept: the same ids (the pre-tokenizer splits at whitespace, so no
        token of the words before the cut depends on what follows), without the cost of
        tokenizing up to 64 KiB only to throw all but a few hundred tokens away. The cut is
        at a space, or just before a punctuation mark or a CJK character (which the
        pre-tokenizer splits off on their own), so a text without spaces is cut too."""
        cut = _boundary_before(text, self.max_length * PREFIX_CHARS_PER_TOKEN)
        if cut > 0:
            head = self._tokenizer.encode(text[:cut], add_special_tokens=True).ids
            if len(head) >= self.max_length:
                return list(head)
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def pad(self, rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        """``input_ids`` and ``attention_mask`` of ``rows`` padded to the longest of them."""
        if not rows:
            raise ValueError("empty batch")
        longest = max(len(r) for r in rows)
        ids = np.full((len(rows), longest), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}


class Engine(Protocol):
    """What the encoder needs of an engine (``workers.engines.onnx.OnnxEngine`` is one)."""

    @property
    def input_names(self) -> tuple[str, ...]: ...

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class EncoderOutputError(RuntimeError):
    """The engine returned a different number or shape of rows than texts it was given."""

    code = "internal"
    retriable = False


class TextEncoder:
    """Embeds texts with an engine whose graph pools and L2-normalizes (output ``embedding``).

    One caller at a time, like the engine it wraps.
    """

    def __init__(
        self,
        engine: Engine,
        preprocessor: TextPreprocessor,
        embedding_dim: int = 384,
        output_name: str = "embedding",
    ) -> None:
        self.engine = engine
        self.preprocessor = preprocessor
        self.embedding_dim = embedding_dim
        self.output_name = output_name

    def embed(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One float32 (embedding_dim,) unit vector per text, in order; [] for [].

        Each text is normalized (``normalize``) before tokenizing, so the result matches
        what the cache keys on. Raises whatever the tokenizer or engine raises, and
        ``EncoderOutputError`` when the engine's output does not have one row per text.
        """
        if not texts:
            return []
        return self._run(self.preprocessor.tokenize_batch([normalize(t) for t in texts]), len(texts))

    def embed_ids(self, rows: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Like ``embed`` from token ids already made (``TextPreprocessor.ids`` of normalized
        texts): the stage tokenizes while the engine runs the batch before."""
        if not rows:
            return []
        return self._run(self.preprocessor.pad(rows), len(rows))

    def _run(self, feeds: dict[str, np.ndarray], n: int) -> list[np.ndarray]:
        outputs = self.engine.run({name: feeds[name] for name in self.engine.input_names})
        rows = outputs[self.output_name]
        if rows.shape != (n, self.embedding_dim):
            raise EncoderOutputError(
                f"engine returned {self.output_name} of shape {rows.shape} for "
                f"{n} texts, expected ({n}, {self.embedding_dim})"
            )
        # Copy each row so one result does not keep the whole batch's buffer alive.
        return [np.array(row, dtype=np.float32) for row in rows]

    def run_batch(self, texts: Sequence[object]) -> list[np.ndarray | Exception]:
        """Like ``embed`` but never raises: each slot holds an embedding or that item's error.

        Non-str items get a ``TypeError`` without touching the engine. If the batch call
        fails, each remaining text is retried alone, so one bad item (or one that makes the
        batch too large) does not fail the others; the retry costs one engine call per item.
        """
        results: list[np.ndarray | Exception | None] = [None] * len(texts)
        good: list[int] = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                good.append(i)
            else:
                results[i] = TypeError(f"text must be str, got {type(t).__name__}")
        if good:
            try:
                for i, emb in zip(good, self.embed([texts[i] for i in good])):  # type: ignore[misc]
                    results[i] = emb
            except Exception as batch_error:
                if len(good) == 1:  # nothing to isolate: the one item is the culprit
                    results[good[0]] = batch_error
                    return results  # type: ignore[return-value]
                log.warning("batch of %d failed (%s); retrying one by one", len(good), batch_error)
                for i in good:
                    try:
                        results[i] = self.embed([texts[i]])[0]  # type: ignore[list-item]
                    except Exception as item_error:
                        results[i] = item_error
        return results  # type: ignore[return-value]

    def warmup(self, n: int = 3) -> None:
        """Run ``n`` rounds of representative batches (batch 1 and a mixed-length batch)."""
        for _ in range(n):
            self.embed(_WARMUP_TEXTS[:1])
            self.embed(_WARMUP_TEXTS)
