"""The ``blocks`` entry point's old name, kept so that ``aios_blocks.cli.main:run`` (an installed
console script made before the split) and code importing from here keep working: the app is in
``cli/app.py``, each command in the module of its noun, the shared parts in ``cli/common.py`` and
``cli/render.py``. Imports only what those import (typer and rich)."""

from __future__ import annotations

from .app import app, run
from .common import (
    DataDir,
    _follow_request,
    _json_option,
    _labels,
    _load,
    _one_line,
    _request,
    _run,
    _seconds,
    _seconds_over,
    _urls,
    _with_client,
    _with_store,
    console,
    err,
)
from .render import _adapt_line, _line, _plain, _print_json, _render_explain, _table

__all__ = [
    "DataDir", "_adapt_line", "_follow_request", "_json_option", "_labels", "_line", "_load", "_one_line", "_plain",
    "_print_json", "_render_explain", "_request", "_run", "_seconds", "_seconds_over", "_table", "_urls", "_with_client",
    "_with_store", "app", "console", "err", "run",
]
