"""What a stage's start-up built is left out of the garbage collector's scans."""

from __future__ import annotations

import gc
import weakref

from streams.stages.runner import freeze_startup_heap


def test_what_start_up_built_is_frozen_and_start_ups_garbage_collected_first() -> None:
    class Node:
        pass

    kept = [object() for _ in range(10)]
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle start-up dropped: collected, not frozen
    dropped = weakref.ref(a)
    del a, b
    gc.unfreeze()
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > len(kept)
        assert dropped() is None  # the cycle was collected first
    finally:
        gc.unfreeze()
