"""The cyclic garbage collector around allocation-heavy work, and at exit."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside; the collector's state is restored after.
    Reference counting still frees everything not in a cycle, and the few cycles made
    meanwhile are collected after. A replay (or a trace load) allocates requests, keys
    and events by the hundred thousand and keeps most of them: the collector's passes
    over them find next to nothing and cost 3-7% of a whole-trace replay."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_frozen_at_exit = False


def freeze_at_exit() -> None:
    """At interpreter shutdown, first move every object to the collector's permanent
    generation, so that its shutdown passes skip them: with numba loaded (its type
    system, compiled functions and caches) those passes cost ~0.2 s of every process
    that ran a replay, for objects the process releases at exit anyway. Nothing changes
    while the process runs (an ``atexit`` hook, registered once)."""
    global _frozen_at_exit
    if not _frozen_at_exit:
        atexit.register(gc.freeze)
        _frozen_at_exit = True
