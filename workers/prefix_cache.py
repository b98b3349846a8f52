"""A bounded, in-process cache of KV state for prompt prefixes, keyed by token blocks.

A prompt is cut into blocks of ``block_tokens`` tokens (only full blocks are cached). Block
``i``'s key hashes block ``i - 1``'s key together with its own tokens, so a key names the
whole prefix up to the end of its block: two prompts share a cached block only when they
agree on every token before it. This is what makes a hit exact: in a causal model a
token's KV depends on the tokens before it and on nothing after.

Values are opaque numpy arrays (the engine stores one block's KV); the cache charges their
``nbytes`` against ``max_bytes`` and evicts least-recently-used blocks past it. An evicted
parent leaves its children unreachable (a lookup stops at the first missing block) until
they age out too.

Not thread-safe: one engine, one caller.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters since creation (blocks, not requests) and current occupancy."""

    hits: int  # blocks found by lookups
    misses: int  # blocks a lookup asked for and did not find (the rest of the prompt's full blocks)
    evictions: int
    entries: int
    bytes: int


class PrefixCache:
    """LRU by bytes over ``block hash -> value``.

    ``namespace`` is mixed into every key: caches of different models or precisions must
    never answer for each other even if someone shares one instance by mistake.
    """

    def __init__(self, max_bytes: int, block_tokens: int = 16, namespace: str = "") -> None:
        if max_bytes < 0 or block_tokens < 1:
            raise ValueError(f"invalid prefix cache limits: max_bytes={max_bytes}, block_tokens={block_tokens}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._root = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def block_hashes(self, tokens: Sequence[int], scope: str = "") -> list[bytes]:
        """Keys of the full blocks of ``tokens``, in order (a trailing partial block has none).
        ``scope`` (a tenant) is mixed in like the namespace: prompts of different scopes
        never share a block, so no tenant learns from a hit what another one sent."""
        keys = []
        parent = self._root if not scope else hashlib.blake2b(self._root + scope.encode(), digest_size=16).digest()
        n = len(tokens) - len(tokens) % self.block_tokens
        for start in range(0, n, self.block_tokens):
            block = np.asarray(tokens[start:start + self.block_tokens], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, keys: Sequence[bytes]) -> list[np.ndarray]:
        """Values of the longest cached run of ``keys`` from the first; marks them recently
        used and counts hits and misses. The arrays are the cache's own: do not modify them."""
        found = []
        for key in keys:
            value = self._blocks.get(key)
            if value is None:
                break
            self._blocks.move_to_end(key)
            found.append(value)
        self._hits += len(found)
        self._misses += len(keys) - len(found)
        return found

    def insert(self, key: bytes, value: np.ndarray) -> None:
        """Store ``value`` (kept as given: pass a copy you will not modify) under ``key``,
        then evict least-recently-used blocks until the total fits ``max_bytes``. A value
        larger than ``max_bytes`` on its own is not stored."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        if value.nbytes > self.max_bytes:
            return
        self._blocks[key] = value
        self._bytes += value.nbytes
        while self._bytes > self.max_bytes:
            _, old = self._blocks.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._hits, self._misses, self._evictions, len(self._blocks), self._bytes)
