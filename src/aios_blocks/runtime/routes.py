"""From a subject to its handler in one jump: each durable consumer's routes (catalog event ->
the module-level function that handles it), read from the workers' own bindings
(``bus.router.Router``), never written by hand. ``blocks subjects --handlers`` prints them, and
docs/subjects.md holds them between its ``handlers`` markers (a unit test keeps the file equal).

The bindings are built with a stand-in for the worker (``_Unbound``): a factory that uses its worker
when binding (rather than when handling) fails here, loudly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..bus.router import Router


class _Unbound:
    """The worker, for bindings built only to be read: its settings are the defaults; anything
    else a factory touches at bind time raises."""

    def __init__(self) -> None:
        from ..settings import Settings

        self.settings = Settings.model_construct()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"bindings built for reading only: no worker {name!r} here")


def factories() -> list[Callable[[Any], list[tuple[Any, Any]]]]:
    """Every consumer's bindings, as the worker kinds build them (``runtime.main``)."""
    from ..agent import fleet
    from ..workers import controller, gateway, mapper, parser, vcluster

    return [parser.bindings, gateway.bindings, controller.bindings, controller.lifecycle_bindings, vcluster.bindings,
            mapper.bindings, fleet.bindings]


def name_of(handler: Any) -> str:
    """``module:qualname`` of the function behind ``handler`` (a ``workers.base.bound`` handler, a
    ``functools.partial``, a bound method, the function itself)."""
    fn = inspect.unwrap(handler)
    while isinstance(fn, functools.partial):
        fn = inspect.unwrap(fn.func)
    fn = getattr(fn, "__func__", fn)
    return f"{fn.__module__}:{fn.__qualname__}"


def rows() -> list[tuple[str, str, str]]:
    """(durable consumer, subject pattern, ``module:function``) for every route of every consumer."""
    out: list[tuple[str, str, str]] = []
    for make in factories():
        for spec, handler in make(_Unbound()):
            routes = handler.routes if isinstance(handler, Router) else []
            out += [(spec.durable, r.event.pattern, name_of(r.handler)) for r in routes]
            if not isinstance(handler, Router):
                out.append((spec.durable, ", ".join(spec.filters), name_of(handler)))
    return out


def markdown() -> str:
    """The handlers table of docs/subjects.md."""
    lines = ["| durable consumer | subject | handler |", "|---|---|---|"]
    lines += [f"| {durable} | `{subject}` | `{handler}` |" for durable, subject, handler in rows()]
    return "\n".join(lines)


BEGIN, END = "<!-- handlers:begin -->", "<!-- handlers:end -->"


def render_into(text: str) -> str:
    """``text`` (docs/subjects.md) with the table between the handler markers replaced."""
    start, stop = text.index(BEGIN), text.index(END)
    return text[: start + len(BEGIN)] + "\n" + markdown() + "\n" + text[stop:]
