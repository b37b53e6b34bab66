"""A Python policy source -> its class in the seed's shape, and the ``print`` it sees.

Only the standard library: a policy process (policies/sandbox.py) imports this when it starts,
and that start is on the way of a worker's first policy calls.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import sys
import threading
import types
from typing import Any

__all__ = ["MAX_PRINT_CHARS", "MAX_PRINT_LINES", "policy_class_from_source"]


def policy_class_from_source(source: str, label: str) -> type:
    """Execute trusted Python source and return the one class defining ``eval``."""
    module = types.ModuleType(f"aios_policy_{hashlib.sha1(label.encode()).hexdigest()[:10]}")
    module.__file__ = label
    module.__dict__["print"] = _policy_print  # the call's log lines, not the worker's stdout
    exec(compile(source, label, "exec"), module.__dict__)
    classes = [
        obj
        for obj in module.__dict__.values()
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and callable(getattr(obj, "eval", None))
    ]
    if len(classes) != 1:
        names = ", ".join(c.__name__ for c in classes) or "none"
        raise ValueError(f"{label}: expected exactly one class with an eval method, found {names}")
    return classes[0]


# What a Python policy source prints during a call becomes that call's log lines (``["print",
# text]``, one per print call), kept in its decision record like a Starlark scriptlet's log_info
# and shown by ``blocks replay`` / ``blocks explain``; ``blocks policy run`` writes them to stderr.
# Bounded: an event must stay far below NATS' payload limit.
MAX_PRINT_LINES = 100
MAX_PRINT_CHARS = 2000
_printed = threading.local()  # .lines: the running call's list (set by _captured), else None


def _policy_print(*values: object, sep: str | None = " ", end: str | None = "\n", file: Any = None,
                  flush: bool = False) -> None:
    """``print`` as a Python policy source sees it. Outside a call (the module's top level, the
    constructor) or with ``file=``, it prints to that file, else to stderr, never to stdout
    (a worker's stdout is its JSON log; ``blocks policy run``'s is the result)."""
    lines: list[list[str]] | None = getattr(_printed, "lines", None)
    if file is not None or lines is None:
        builtins.print(*values, sep=sep, end=end, file=file if file is not None else sys.stderr, flush=flush)
        return
    text = (" " if sep is None else sep).join(map(str, values))
    if len(lines) < MAX_PRINT_LINES:
        lines.append(["print", text[:MAX_PRINT_CHARS]])
    elif len(lines) == MAX_PRINT_LINES:
        lines.append(["warn", "(more printed lines dropped)"])
