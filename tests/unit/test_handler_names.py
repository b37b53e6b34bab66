"""One jump from a subject to its handler: every route of the controller's and the mapper's
consumers names a module-level function (``__module__`` + ``__qualname__``), not a closure."""

from __future__ import annotations

import importlib
from typing import Any, cast

from aios_blocks.bus.router import Router
from aios_blocks.workers import controller, mapper


def _routes() -> list[tuple[str, str, Any]]:
    w = cast(Any, None)  # binding names the handlers only: no worker is called
    binds = [*controller.bindings(w), *controller.bindings(w, "c1"), *controller.lifecycle_bindings(w), *mapper.bindings(w)]
    out = []
    for spec, router in binds:
        assert isinstance(router, Router)
        out += [(spec.durable, r.event.name, r.handler) for r in router.routes]
    return out


def test_every_controller_and_mapper_handler_is_a_module_level_function() -> None:
    routes = _routes()
    assert len(routes) >= 20
    for durable, event, handler in routes:
        where = f"{durable} {event}: {handler.__module__}:{handler.__qualname__}"
        assert "<locals>" not in handler.__qualname__, where
        fn = getattr(importlib.import_module(handler.__module__), handler.__qualname__, None)
        assert fn is not None and fn is getattr(handler, "__wrapped__", handler), where
