"""Issue 35's measure of the code's complexity: radon's cyclomatic complexity rates no function
E or F (over 30) and at most 5 functions D (21-30), over every module of the package. A function
that grows past them is split into helpers that each do one thing (e.g. the rebalancer's
``plan``), rather than the limits raised."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from radon.complexity import cc_rank, cc_visit
from radon.visitors import Class, Function

import aios_blocks

ROOT = Path(aios_blocks.__file__).resolve().parent
#: how many functions may be rated D (21-30)
MAX_D = 5


def _blocks(items: list[Function | Class]) -> Iterator[Function | Class]:
    """What ``radon cc`` lists: functions, classes and each class's methods."""
    for b in items:
        yield b
        if isinstance(b, Class):
            yield from b.methods


def _rated() -> dict[str, tuple[str, int]]:
    """``module:line name`` -> (rank, complexity) for every block of the package rated D or worse."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        for b in _blocks(cc_visit(p.read_text())):
            rank = cc_rank(b.complexity)
            if rank in "DEF":
                out[f"{p.relative_to(ROOT)}:{b.lineno} {b.fullname}"] = (rank, b.complexity)
    return out


def test_no_function_is_rated_e_or_f_and_at_most_five_d() -> None:
    rated = _rated()
    worse = {k: v for k, v in rated.items() if v[0] in "EF"}
    assert not worse, f"rated E/F (complexity over 30): {worse}"
    d = {k: v[1] for k, v in rated.items() if v[0] == "D"}
    assert len(d) <= MAX_D, f"{len(d)} rated D (complexity 21-30), at most {MAX_D}: {d}"


def test_the_measure_sees_a_complex_function() -> None:
    """The check is not vacuous: a function of 31 branches is rated worse than D."""
    src = "def f(x):\n" + "".join(f"    if x == {k}:\n        return {k}\n" for k in range(30)) + "    return -1\n"
    (f,) = cc_visit(src)
    assert f.complexity == 31 and cc_rank(f.complexity) == "E"
