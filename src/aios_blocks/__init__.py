"""aios-blocks: an event-driven control plane for AI blocks.

Layout (``src/aios_blocks``): ``schemas`` (the language), ``bus`` (NATS), ``state`` (Redis),
``policies``, ``handlers`` (decisions), ``workers`` (processes, node agent), ``cli``, and
``examples`` (shipped with the wheel so ``blocks demo`` works from an installed package).
"""

import importlib
import importlib.util
import sys
import types
from typing import Any

__version__ = "0.1.0"


class OnFirstUse(types.ModuleType):
    """Stands in ``sys.modules`` for a module not loaded yet; its first attribute that it does not
    have (``aiohttp.ClientSession``; a submodule's import reads ``__path__``) loads the module
    itself, which then replaces it there. Only ``__name__``/``__spec__`` are its own, which is what
    an ``import`` statement of a module already in ``sys.modules`` reads; importlib's
    ``LazyLoader`` is not enough for that: any attribute loads it, ``__spec__`` included, so the
    next ``import`` of it anywhere loads it."""

    def __getattr__(self, attr: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        real = importlib.import_module(self.__name__)
        self.__dict__.update(real.__dict__)  # whoever holds this one from now on reads the real one's
        return getattr(real, attr)


def _load_on_first_use(name: str) -> None:
    """Leave ``name`` unloaded until it is used. For aiohttp: nats-py imports it for its websocket
    transport, which a ``nats://`` or ``tls://`` URL never uses, and it was ~0.25-0.35 s of every
    ``blocks`` command's start-up (half of importing nats-py). What does use it (the executor, the
    console, the agents' probes) loads it whole at its first ``aiohttp.X`` or ``from aiohttp import
    web``. Nothing changes where it is loaded already or not installed."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    stand_in = OnFirstUse(name)
    stand_in.__spec__ = spec
    sys.modules[name] = stand_in


_load_on_first_use("aiohttp")
