"""Equality filters over documents' metadata: for each scalar value of each key, the slots of
the documents holding it (a posting list), so a filter's admitted documents are found without
scanning. A filter maps keys to a value or a list of values (any of them); every key must
match. ``bool`` values are kept apart from ``int`` (``True`` is not ``1``); non-scalar values
are not indexed and never match.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Mapping

Term = tuple[str, bool, Hashable]


def term(key: str, value: Any) -> Term | None:
    """The posting key of one metadata value (scalars only; bool kept apart from int)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return key, isinstance(value, bool), value
    return None


def terms(meta: Mapping[str, Any] | None) -> Iterable[Term]:
    for key, value in (meta or {}).items():
        t = term(key, value)
        if t is not None:
            yield t


def _values(wanted: Any) -> Iterable[Any]:
    return wanted if isinstance(wanted, (list, tuple, set, frozenset)) else (wanted,)


class Postings:
    """Posting lists of slot numbers. Each list is the keys of a dict: a dict of ints is not
    tracked by the garbage collector, a set always is (a set per term made 64k tracked
    objects at 100k passages, and a full collection 90 ms: docs/retrieval.md)."""

    def __init__(self) -> None:
        self._lists: dict[Term, dict[int, None]] = {}

    def add(self, slot: int, meta: Mapping[str, Any] | None) -> None:
        for t in terms(meta):
            self._lists.setdefault(t, {})[slot] = None

    def remove(self, slot: int, meta: Mapping[str, Any] | None) -> None:
        for t in terms(meta):
            slots = self._lists.get(t)
            if slots is not None:
                slots.pop(slot, None)
                if not slots:
                    del self._lists[t]

    def admitted(self, where: Mapping[str, Any]) -> set[int]:
        """Slots whose meta matches every key of ``where``."""
        result: set[int] | None = None
        for key, wanted in sorted(where.items(), key=lambda kv: str(kv[0])):
            matching: set[int] = set()
            for value in _values(wanted):
                t = term(key, value)
                if t is not None:
                    matching.update(self._lists.get(t, ()))
            result = matching if result is None else result & matching
            if not result:
                return set()
        return result or set()


def admits(where: Mapping[str, Any], meta: Mapping[str, Any] | None) -> bool:
    """Whether ``where`` admits a document with ``meta``: what ``Postings.admitted`` decides, for one."""
    held = set(terms(meta))
    return all(any(term(key, value) in held for value in _values(wanted)) for key, wanted in where.items())
