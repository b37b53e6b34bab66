"""Replay and recovery, in one place: the fold that re-runs the workers' rules over the stream
(``fold``), the state image and its digest (``image``), rebuilding Redis from the stream and the
state epoch (``rebuild``), and the invariants checked against both (``invariants``). Keys come
from ``state.keys``; the lifecycle rules from ``schemas.lifecycle``."""
