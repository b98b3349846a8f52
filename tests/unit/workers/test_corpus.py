"""The offline passage corpus: deterministic, stable ids, deduplicated, near-duplicate queries."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from workers.retrieval import corpus as C

SENTENCE = ("The consumer group keeps each partition with exactly one member, so a stage scales by adding "
            "replicas while every message is still handled once. ")


def para(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = SENTENCE.split()
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f'"""{para(60, 1)}"""\n\n\ndef f():\n    """{para(50, 2)}"""\n')
    (pkg / "mod.py").write_text(f'# {para(45, 3)}\nx = 1\n\nclass K:\n    """{para(300, 4)}"""\n')
    (pkg / "broken.py").write_text('def (:\n    """never read"""\n')
    (pkg / "copy.py").write_text(f'"""{para(60, 1).upper()}"""\n')  # the __init__ docstring again, other case
    (pkg / "tests").mkdir()
    (pkg / "tests" / "test_x.py").write_text(f'"""{para(80, 5)}"""\n')
    (tmp_path / "README.md").write_text(para(70, 6) + "\n\n" + "| a | b |\n" * 30)
    return tmp_path


def test_passages_are_sized_deduplicated_and_described(tree: Path) -> None:
    passages = C.load_corpus([tree])
    assert passages
    for p in passages:
        n = len(p.text.split())
        assert C.MIN_WORDS <= n <= C.MAX_WORDS
        assert p.id == C.passage_id(p.text)
        assert p.meta["package"] in ("pkg", "README")
    sources = {p.meta["source"] for p in passages}
    assert "pkg/copy.py" not in sources  # same text as __init__'s, case folded
    assert not any("tests/" in s for s in sources)
    assert "pkg/broken.py" not in sources
    assert "pkg/mod.py" in sources and "README.md" in sources
    assert len({p.id for p in passages}) == len(passages)


def test_a_long_docstring_is_cut_into_several_passages(tree: Path) -> None:
    pieces = [p for p in C.load_corpus([tree]) if p.meta["source"] == "pkg/mod.py"]
    assert len(pieces) >= 4  # 45 comment words + 300 docstring words


def test_the_corpus_is_deterministic(tree: Path) -> None:
    a, b = C.load_corpus([tree]), C.load_corpus([tree])
    assert [(p.id, p.text, p.meta) for p in a] == [(p.id, p.text, p.meta) for p in b]
    assert C.fingerprint(a) == C.fingerprint(b)
    assert C.fingerprint(a[:-1]) != C.fingerprint(a)
    assert C.load_corpus([tree], limit=2) == a[:2]


def test_a_real_sample_is_fast_and_stable() -> None:
    sample = C.load_corpus(limit=30)
    assert len(sample) == 30
    assert [p.id for p in sample] == [p.id for p in C.load_corpus(limit=30)]
    assert all(C.is_prose(p.text) for p in sample)


def test_chunk_joins_short_paragraphs_and_drops_a_short_tail() -> None:
    text = "\n\n".join([para(20, 1), para(25, 2), para(10, 3)])
    assert [len(c.split()) for c in C.chunk(text)] == [55]
    assert C.chunk(para(30, 1)) == []


def test_ids_hash_the_text() -> None:
    assert C.passage_id("abc") == C.passage_id("abc") != C.passage_id("abd")
    assert len(C.passage_id("abc")) == 16


def test_near_duplicates_are_deterministic_and_close() -> None:
    q = "How does the consumer group assign partitions to members?"
    assert C.near_duplicate(q, 7) == C.near_duplicate(q, 7)
    variants = {C.near_duplicate(q, s) for s in range(40)}
    assert len(variants) > 5 and q not in variants
    for v in variants:
        assert abs(len(v.split()) - len(q.split())) <= 1


@pytest.mark.parametrize("kind", C.PERTURBATIONS)
def test_each_perturbation_changes_the_query(kind: str) -> None:
    q = "Offsets are committed below the lowest unfinished record"
    out = C._perturb(q, kind, random.Random(3))
    assert out != q
    assert out.lower().replace("?", "") != q.lower() or kind in ("case", "punctuation")


def test_query_of_is_a_run_of_the_passage() -> None:
    p = C.Passage("x", para(60, 9), {})
    q = C.query_of(p, random.Random(1))
    assert 8 <= len(q.split()) <= 16 and q in p.text
