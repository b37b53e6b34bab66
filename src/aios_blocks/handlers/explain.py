"""Moved: ``blocks explain`` is a projection of the stored stream (``projections.explain``); this
name stays only for callers not yet moved."""

from ..projections.explain import explain

__all__ = ["explain"]
