"""pytest plugin for the mutation run (``make mutate``): mutmut runs pytest many times in one
process, and a module that configured structlog at import (``cli.main``) keeps the stderr of the
session that imported it, closed by the next one. Each session points structlog at whatever
``sys.stderr`` is when a line is written."""

from __future__ import annotations

import sys
from typing import Any

import structlog


class _Stderr:
    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def pytest_runtest_setup(item: Any) -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_Stderr()),
                        wrapper_class=structlog.make_filtering_bound_logger(30))
