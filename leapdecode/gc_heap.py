"""The start-up heap out of the garbage collector's way while a command serves.

CPython's collector examines every tracked object in a full (oldest-generation) collection. After importing torch
and transformers and building an engine about 240k objects are tracked (the bundled model under ``auto``), and a
full collection took ~100 ms here, a pause in every stream in flight, triggered by whatever allocates next (the
suffix drafter's global trie, a tokenizer call): once per ~32 chat requests under ``auto``. None of those start-up
objects is freed while the command serves, so they sit in the collector's permanent generation (``gc.freeze``)
meanwhile; the collections examine only what the process made since (longest pause over 32 requests 98-105 ->
0.6-0.7 ms, measured).

``leapdecode serve``, ``bench`` and ``chat`` hold their engines for as long as they run. The heap is unfrozen when
the command returns: an engine holds reference cycles, and a frozen one dropped later would never be collected (a
program that runs several commands in one process, as the tests do, gets its memory back). The library leaves its
caller's heap alone; a long-lived program of one's own can wrap its serving loop in :func:`startup_heap_frozen`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_heap_frozen() -> Iterator[int]:
    """Collect what start-up left over and freeze every object alive now (yields how many) until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()


__all__ = ["startup_heap_frozen"]
