"""Readers of the stored stream (the fold, explain, the CLI's lines), dispatched through the
catalog: ``projections.base.Projection``."""

from .base import INDEX, Fact, Projection, handled, on, parse, stored_events

__all__ = ["INDEX", "Fact", "Projection", "handled", "on", "parse", "stored_events"]
