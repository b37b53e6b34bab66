"""The policy-URI table moved to :mod:`aios_blocks.schemas.uris` (the contract lives in
``schemas/``, which imports nothing else of the package). Add a built-in there; this name stays as
a re-export."""

from __future__ import annotations

from ..schemas.uris import BUILTIN_KINDS as BUILTIN_KINDS
from ..schemas.uris import known_builtins as known_builtins
from ..schemas.uris import uri_problem as uri_problem
