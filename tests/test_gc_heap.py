"""gc_heap: the start-up heap frozen while a command serves, and given back to the collector when it returns."""

from __future__ import annotations

import gc
import weakref

from leapdecode.gc_heap import startup_heap_frozen


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_heap_is_frozen_inside_and_collectable_again_after() -> None:
    made_before = Cycle()
    ref = weakref.ref(made_before)
    with startup_heap_frozen() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del made_before
        gc.collect()
        assert ref() is not None  # frozen: a full collection does not examine it
        made_inside = weakref.ref(Cycle())
        gc.collect()
        assert made_inside() is None  # what the command makes meanwhile is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # unfrozen when the block ends: nothing frozen is lost for good
