"""The start-up heap is frozen out of the collector's sight; what comes later is
collected as before (engine/platform/heap.py)."""
import gc
import weakref

from kvserve.engine.platform.heap import freeze_startup_heap


class _Node:
    pass


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected():
    try:
        before = _Node()
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # out of the generations
        later = _cycle()  # a reference cycle made after start-up, then dropped
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
