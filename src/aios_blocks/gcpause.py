"""The cyclic garbage collector held off while a long pass builds many long-lived objects.

A full collection walks every tracked object again; a pass that makes hundreds of thousands of
dicts that live to its end (the recovery's fold of the stream, the trace replay's policy memos)
pays for that walk over and over: a third of a 1M-event fold's time, about a third of the
default trace replay's (docs/trace.md, docs/reliability.md). No result depends on it: cycles
made meanwhile are collected afterwards (or by the caller's own young-generation collections).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic collection off inside the block, restored to what it was after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
