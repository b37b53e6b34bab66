"""``workers.allocate._reservations``: the redelivery check's reservations, answered from the first
instance's read with the step's first read (``controller.on_allocation``) where that settles
``allocation.reused``, else read for every instance as before."""

from __future__ import annotations

from typing import Any

from aios_blocks.handlers import allocation as al
from aios_blocks.workers.allocate import _reservations

HELD = {"node": "n1", "gpus": '["g0"]'}


class _Store:
    def __init__(self, held: dict[str, dict[str, str]]):
        self.held, self.reads = held, 0

    async def reservations_of(self, cid: str, iids: list[str]) -> list[dict[str, str] | None]:
        self.reads += 1
        return [self.held.get(i) for i in iids]


class _W:
    def __init__(self, held: dict[str, dict[str, str]]):
        self.store = _Store(held)


async def _check(iids: tuple[str, ...], held: dict[str, dict[str, str]], ahead: Any, reads: int) -> None:
    w: Any = _W(held)
    got = await _reservations(w, "c", iids, ahead)
    assert w.store.reads == reads
    # the same answer as every instance's read
    assert al.reused(iids, got) == al.reused(iids, [held.get(i) for i in iids])


async def test_the_first_instance_s_read_answers_where_it_settles_the_check() -> None:
    await _check(("b-0",), {}, ("b-0", None), 0)  # not held: plan
    await _check(("b-0",), {"b-0": HELD}, ("b-0", HELD), 0)  # the only instance, held: reuse
    await _check(("b-0", "b-1"), {"b-1": HELD}, ("b-0", None), 0)  # the first not held: no gang held


async def test_every_instance_is_read_where_it_does_not() -> None:
    await _check(("b-0", "b-1"), {"b-0": HELD, "b-1": HELD}, ("b-0", HELD), 1)  # a larger gang held
    await _check(("b-0", "b-1"), {"b-0": HELD}, ("b-0", HELD), 1)  # part of it
    await _check(("b-x1",), {"b-x1": HELD}, ("b-0", None), 1)  # other ids (a preempted block's)
    await _check(("b-0",), {"b-0": HELD}, None, 1)  # nothing read ahead (scale, reassignment)
