"""Fault points for the chaos tests (docs/priority.md "Safe under faults"): a process SIGKILLs
itself at a named point, once.

``AIOS_FAULT=<point>:<file>`` (read when the point is reached, not at import): the first process
of the deployment that reaches ``<point>`` and removes ``<file>`` (atomic: only one can) dies there
by SIGKILL, as a crash would take it, with nothing flushed. Unset (every deployment but a test):
a point costs one environment lookup."""

from __future__ import annotations

import os
import signal


def hit(point: str) -> None:
    spec = os.environ.get("AIOS_FAULT")
    if not spec:
        return
    name, _, path = spec.partition(":")
    if name != point or not path:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
