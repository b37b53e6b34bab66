"""``workers.allocate.Turn``: a cluster's allocation steps take the lock in the order they were
delivered; a step that leaves without planning passes its turn on only once the step before it
has passed (else the one after it would overtake that one)."""

from __future__ import annotations

import asyncio

from aios_blocks.workers.allocate import Turn, _turns


async def test_steps_pass_in_delivery_order_and_an_early_leaver_waits_for_the_one_before() -> None:
    first, second, third = Turn("c"), Turn("c"), Turn("c")
    other = Turn("d")  # another cluster's step waits for nobody
    passed: list[str] = []

    async def step(name: str, turn: Turn) -> None:
        await turn.wait()
        passed.append(name)
        turn.leave()

    later = [asyncio.create_task(step("third", third)), asyncio.create_task(step("other", other))]
    second.leave()  # gone before its turn (its block was no longer allocating)
    await asyncio.sleep(0.01)
    assert passed == ["other"]  # the third waits for the first, which the second was behind
    await step("first", first)
    await asyncio.gather(*later)
    assert passed == ["other", "first", "third"]
    assert "c" not in _turns and "d" not in _turns  # nothing kept once every step has passed


async def test_a_cancelled_step_does_not_hold_the_next_one() -> None:
    first, second = Turn("e"), Turn("e")
    waiting = asyncio.create_task(second.wait())
    await asyncio.sleep(0)
    blocked = asyncio.create_task(Turn("e").wait())  # a third, behind the second
    await asyncio.sleep(0)
    waiting.cancel()  # the second step cancelled while waiting: its handler's finally leaves
    second.leave()
    await asyncio.sleep(0.01)
    assert not blocked.done()  # still behind the first
    first.leave()
    await asyncio.wait_for(blocked, 1.0)


def test_a_step_left_behind_by_a_closed_event_loop_holds_no_step_of_a_new_one() -> None:
    """A worker stopped with a step in flight whose loop was closed before its ``finally`` ran
    leaves that step's turn unpassed: a later loop's steps of the same cluster do not wait for it."""
    loop = asyncio.new_event_loop()

    async def stranded() -> None:
        Turn("f")  # taken, never left

    loop.run_until_complete(stranded())
    loop.close()

    async def fresh() -> None:
        turn = Turn("f")
        await asyncio.wait_for(turn.wait(), 1.0)
        turn.leave()

    asyncio.run(fresh())
    assert "f" not in _turns
