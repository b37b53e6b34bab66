"""Tenant and tenant-user names told apart regardless of case (``runtime.auth``'s adds): a new name
that differs from a held one only in case is refused."""

from __future__ import annotations

from collections.abc import Iterable


def refuse_case_twin(what: str, name: str, held: Iterable[str]) -> None:
    """Refuse (ValueError: bad input, exit 2) a new ``name`` that differs from one held only in case
    (``acme`` and ``Acme``): two accounts and credentials folders that a reader takes for one (and
    one folder on a case-insensitive file system). A name already held passes: names stored so by
    an older version stay as they are."""
    held = sorted(held)
    if name in held:
        return
    other = next((h for h in held if h.casefold() == name.casefold()), None)
    if other is not None:
        raise ValueError(f"{what} {name!r} differs from the existing {other!r} only in case (taken for one): "
                         f"give {other!r} to mean that one, or another name")
