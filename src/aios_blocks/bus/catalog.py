"""The event catalog moved to :mod:`aios_blocks.schemas.catalog` (the pure contract lives in
``schemas/``, so handlers need not import ``bus/``). This name stays as a re-export for the code
that still imports it from here."""

from __future__ import annotations

from ..schemas.catalog import *  # noqa: F403
