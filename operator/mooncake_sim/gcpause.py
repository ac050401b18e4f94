"""Pausing the cyclic garbage collector around allocation-heavy work."""

from __future__ import annotations

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
