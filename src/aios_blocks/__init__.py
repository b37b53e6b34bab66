"""aios-blocks: an event-driven control plane for AI blocks.

Layout (``src/aios_blocks``): ``schemas`` (the language), ``bus`` (NATS), ``state`` (Redis),
``policies``, ``handlers`` (decisions), ``workers`` (processes, node agent), ``cli``, and
``examples`` (shipped with the wheel so ``blocks demo`` works from an installed package).
"""

__version__ = "0.1.0"
