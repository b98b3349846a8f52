"""Per-item error isolation for encoders that decode their inputs first: one broken input,
or one that breaks the engine, never fails the others of its batch."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

D = TypeVar("D")
O = TypeVar("O")

log = logging.getLogger(__name__)


def decode_then_encode(items: Sequence[Any], decode: Callable[[Any], D],
                       encode: Callable[[list[D]], list[O]]) -> list[O | Exception]:
    """``decode`` each item (its exception becomes its result), ``encode`` the decoded ones
    in one call, and if that call fails retry them one by one. One result per item, in order."""
    results: list[Any] = [None] * len(items)
    decoded: dict[int, D] = {}
    for i, item in enumerate(items):
        try:
            decoded[i] = decode(item)
        except Exception as item_error:
            results[i] = item_error
    if decoded:
        try:
            for i, out in zip(decoded, encode(list(decoded.values()))):
                results[i] = out
        except Exception as batch_error:
            if len(decoded) == 1:
                results[next(iter(decoded))] = batch_error
            else:
                log.warning("batch of %d failed (%s); retrying one by one", len(decoded), batch_error)
                for i, value in decoded.items():
                    try:
                        results[i] = encode([value])[0]
                    except Exception as item_error:
                        results[i] = item_error
    return results
