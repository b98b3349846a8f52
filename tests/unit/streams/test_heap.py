"""What a process built is left out of the garbage collector's scans (``streams.runtime.heap``)."""

from __future__ import annotations

import gc
import weakref

from streams.runtime.heap import freeze_heap


def test_what_lives_is_frozen_and_the_garbage_so_far_collected_first() -> None:
    class Node:
        pass

    kept = ["built at start-up"]  # a list: tracked by the collector; kept
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle dropped before the freeze: collected, not frozen
    dropped = weakref.ref(a)
    del a, b
    gc.unfreeze()
    try:
        frozen = freeze_heap()
        assert frozen > 0  # (the count falls as frozen objects are freed by reference counting)
        assert dropped() is None
        assert not any(o is kept for o in gc.get_objects())  # no generation walks it any more
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
