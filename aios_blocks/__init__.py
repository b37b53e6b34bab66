"""aios-blocks: an event-driven control plane for AI blocks.

The project's top-level folders (``schemas/``, ``bus/``, ``state/``, ``policies/``,
``handlers/``, ``workers/``, ``cli/``) are installed under this one namespace, so an installed
client sees ``aios_blocks.bus`` and never a bare top-level ``bus``.
"""

__version__ = "0.1.0"
