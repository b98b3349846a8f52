"""Keep what a process built out of the garbage collector's full collections.

A full collection walks every tracked object to find the few cycles of the records just
handled. A stage's heap is mostly what it built once and keeps (modules, the engine's
wrappers, the tokenizer's tables, the app; a retrieve replica's index): measured, 100-200 ms
per full collection per stage, several a minute under load and every stage's at nearly the same
moment, since each allocates in step with the same traffic (docs/capacity.md, "Stop 55"). A
request arriving then waited for it.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect once, then move every object alive out of the collector's generations
    (``gc.freeze``): later full collections walk only what came after. Frozen objects are still
    freed by reference counting; only a cycle among them would stay (the garbage made so far is
    collected first). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
