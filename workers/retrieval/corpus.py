"""A deterministic offline corpus of real text passages, and near-duplicate queries of them.

The passages are what the installed Python packages and the standard library say about
themselves: docstrings and comment blocks of their ``.py`` files (read with ``ast``, never
imported) and their ``.md``/``.rst``/``.txt`` documents, in sorted path order, cut into passages of ``MIN_WORDS``-``MAX_WORDS`` words,
deduplicated (case and whitespace folded). A passage's id is a hash of its text, so the
same text has the same id on any machine; which passages exist depends on what is installed
(``fingerprint`` names the set, and keys anything derived from it).

``near_duplicate`` perturbs a query the way people retype one (case, punctuation, a dropped
or swapped word, a typo), deterministically from a seed.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

MIN_WORDS = 40
MAX_WORDS = 120
JOIN_WORDS = 80
"""Paragraphs are joined into one passage while it stays this short; a longer paragraph is
cut into pieces of about MIN_WORDS..JOIN_WORDS words."""
MAX_FILE_BYTES = 2_000_000
"""Larger files are generated tables or vendored bundles, not prose: skipped."""
DOC_SUFFIXES = (".md", ".rst", ".txt")
PROSE_SHARE = 0.6
"""A passage keeps only if this share of its words are plain words (letters, maybe ending
in punctuation): drops code listings, tables and hex dumps."""
CORPUS_VERSION = "passages-v1"
"""Names the chunking and filtering here; ``fingerprint`` includes it."""

_WORD = re.compile(r"^[A-Za-z][A-Za-z'\-]*[.,;:!?)]?$")
_SKIP_DIRS = {"__pycache__", "tests", "test", "testing", "site-packages", "idlelib", "lib2to3"}
_COMMENT = re.compile(r"^[ \t]*#(?![!]|.*coding[:=]|\s*(?:noqa|type:|pragma|pylint|fmt:))[ \t]?(.*)$")


@dataclass(frozen=True)
class Passage:
    """One passage: ``id`` (first 16 hex digits of the SHA-256 of ``text``), ``text`` (one
    line, single spaces) and ``meta`` (``package``: the top-level name under site-packages;
    ``source``: the file's path relative to it)."""

    id: str
    text: str
    meta: dict[str, str] = field(hash=False, compare=False)


def passage_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_roots() -> tuple[Path, ...]:
    """The standard library and the site-packages of the running interpreter (the venv)."""
    paths = sysconfig.get_paths()
    return Path(paths["stdlib"]), Path(paths["purelib"])


def iter_files(root: Path) -> Iterator[Path]:
    """Source and document files under ``root`` in sorted order (tests and caches skipped)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") or name.endswith(DOC_SUFFIXES):
                yield Path(dirpath) / name


def texts_of(path: Path) -> list[str]:
    """The prose of one file as paragraphs: its docstrings (module, classes, functions) and
    then its comment blocks (a ``.py`` file that does not parse gives none) or, for a
    document, the whole text."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return []
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    if not path.name.endswith(".py"):
        return [raw]
    try:
        tree = ast.parse(raw)
    except (SyntaxError, ValueError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
    block: list[str] = []
    for line in raw.splitlines() + [""]:
        m = _COMMENT.match(line)
        if m:
            block.append(m.group(1))
        elif block:
            out.append(" ".join(block))
            block = []
    return out


def chunk(text: str) -> list[str]:
    """``text`` cut into passages of MIN_WORDS..MAX_WORDS words: paragraphs (blank-line
    separated) are joined while they fit in JOIN_WORDS, a long paragraph is cut into equal
    pieces, a remainder too short to stand alone is dropped."""
    out: list[str] = []
    pending: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        words = para.split()
        if not words:
            continue
        if len(pending) + len(words) <= JOIN_WORDS:
            pending += words
            continue
        if len(pending) >= MIN_WORDS:
            out.append(" ".join(pending))
            pending = []
        words = pending + words
        pending = []
        if len(words) <= JOIN_WORDS:
            pending = words
            continue
        pieces = -(-len(words) // ((MIN_WORDS + JOIN_WORDS) // 2))
        size = -(-len(words) // pieces)
        for i in range(0, len(words), size):
            piece = words[i:i + size]
            if len(piece) >= MIN_WORDS:
                out.append(" ".join(piece))
            else:
                pending = piece
    if len(pending) >= MIN_WORDS:
        out.append(" ".join(pending))
    return out


def is_prose(passage: str) -> bool:
    words = passage.split()
    return sum(1 for w in words if _WORD.match(w)) >= PROSE_SHARE * len(words)


def load_corpus(roots: Sequence[Path] | None = None, limit: int | None = None) -> list[Passage]:
    """The passages under ``roots`` (default: ``default_roots()``), root by root in file
    order, each text once; at most ``limit`` of them (the first ones: a fast sample)."""
    seen: set[str] = set()
    out: list[Passage] = []
    for root in roots or default_roots():
        if _collect(root, seen, out, limit):
            break
    return out


def _collect(root: Path, seen: set[str], out: list[Passage], limit: int | None) -> bool:
    """Appends ``root``'s new passages to ``out``; True once ``limit`` is reached."""
    for path in iter_files(root):
        rel = path.relative_to(root)
        package = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.suffix == ".py" else rel.stem
        # A file's docstrings are its paragraphs, in order: short ones join into passages.
        for piece in chunk("\n\n".join(texts_of(path))):
            fold = " ".join(piece.lower().split())
            if fold in seen or not is_prose(piece):
                continue
            seen.add(fold)
            out.append(Passage(passage_id(piece), piece, {"package": package, "source": rel.as_posix()}))
            if limit is not None and len(out) >= limit:
                return True
    return False


def fingerprint(passages: list[Passage]) -> str:
    """A name for exactly this list of passages (and the chunking that made it)."""
    h = hashlib.sha256(CORPUS_VERSION.encode())
    for p in passages:
        h.update(p.id.encode())
    return h.hexdigest()[:16]


def query_of(passage: Passage, rng: random.Random, words: tuple[int, int] = (8, 16)) -> str:
    """A query a reader of ``passage`` might type: a run of ``words`` (min, max) consecutive
    words of it, from a place ``rng`` picks."""
    tokens = passage.text.split()
    n = min(len(tokens), rng.randint(*words))
    start = rng.randint(0, len(tokens) - n)
    return " ".join(tokens[start:start + n])


PERTURBATIONS = ("case", "punctuation", "drop_word", "swap_words", "typo")


def near_duplicate(query: str, seed: int, edits: int = 1) -> str:
    """``query`` retyped with ``edits`` perturbations (from ``PERTURBATIONS``, chosen with
    ``seed``): the same ``(query, seed, edits)`` always gives the same string. A one-word
    query loses no word."""
    rng = random.Random(f"{seed}:{query}")
    out = query
    for _ in range(edits):
        out = _perturb(out, rng.choice(PERTURBATIONS), rng)
    return out


def _perturb(query: str, kind: str, rng: random.Random) -> str:
    words = query.split()
    if kind == "case":
        return query.lower() if query != query.lower() else query.capitalize()
    if kind == "punctuation":
        stripped = re.sub(r"[^\w\s]", "", query)
        return stripped if stripped != query else query + "?"
    if kind == "drop_word" and len(words) > 1:
        del words[rng.randrange(len(words))]
    elif kind == "swap_words" and len(words) > 1:
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    elif kind == "typo":
        candidates = [i for i, w in enumerate(words) if len(w) >= 3]
        if candidates:
            i = rng.choice(candidates)
            w = words[i]
            j = rng.randrange(len(w) - 1)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]  # two neighbouring letters swapped
    return " ".join(words)
