"""The one lifecycle table: every step's sources and target, and the recovery fold applying it."""

from __future__ import annotations

import itertools

import pytest

from aios_blocks.recovery.fold import Fold
from aios_blocks.schemas.lifecycle import LIVE, REUSABLE, TRANSITIONS, BlockStatus, Step, fail_step, into

S = BlockStatus


def test_the_happy_path_is_a_chain_of_steps() -> None:
    status = S.PARSED
    for step in (Step.SELECT, Step.CHOOSE, Step.RESERVE, Step.READY, Step.DELETE, Step.DELETED):
        rule = TRANSITIONS[step]
        assert rule.allows(status), (step, status)
        status = rule.target
    assert status is S.DELETED and status in REUSABLE


def test_terminal_statuses_leave_only_by_delete_and_deleted_goes_nowhere() -> None:
    for status in (S.FAILED, S.REJECTED):
        assert [s for s, t in TRANSITIONS.items() if t.allows(status)] == [Step.DELETE]
    assert not [s for s, t in TRANSITIONS.items() if t.allows(S.DELETED)]
    assert REUSABLE == {S.DELETED, S.REJECTED, S.FAILED} and LIVE == {S.PLACING, S.READY}


def test_every_status_is_reachable_and_fail_steps_match_their_status() -> None:
    targets = {t.target for t in TRANSITIONS.values()}
    assert set(S) - targets == {S.REJECTED}  # created by the parser (CREATE_BLOCK), never a step
    for status in (S.SELECTING, S.ALLOCATING, S.PLACING):
        step = fail_step(status)
        assert TRANSITIONS[step].sources == {status} and TRANSITIONS[step].target is S.FAILED
    assert into(S.READY) == {S.READY, S.PLACING, S.ALLOCATING}
    assert into(S.FAILED) == {S.FAILED, S.SELECTING, S.ALLOCATING, S.PLACING, S.PENDING}


def test_a_block_that_fits_nowhere_waits_then_retries_expires_or_is_deleted() -> None:
    """The pending queue (docs/priority.md): selecting/allocating -> pending, a whole victim of a
    preemption too; pending leaves by a retry (back to parsed), expiry (failed) or delete."""
    assert TRANSITIONS[Step.WAIT].sources == {S.SELECTING, S.ALLOCATING, S.PENDING}
    assert TRANSITIONS[Step.PREEMPTED].sources == {S.PLACING, S.READY} and TRANSITIONS[Step.PREEMPTED].target is S.PENDING
    assert {s for s, t in TRANSITIONS.items() if t.allows(S.PENDING)} == {Step.WAIT, Step.RETRY, Step.EXPIRE, Step.DELETE}
    assert TRANSITIONS[Step.RETRY].target is S.PARSED and TRANSITIONS[Step.EXPIRE].target is S.FAILED
    assert into(S.PENDING) == {S.PENDING, S.SELECTING, S.ALLOCATING, S.PLACING, S.READY}


@pytest.mark.parametrize(("status", "step"), list(itertools.product(list(S), list(Step))))
def test_the_recovery_fold_takes_exactly_the_table_s_steps(status: BlockStatus, step: Step) -> None:
    fold = Fold()
    fold.blocks["b"] = {"gen": "1", "status": status.value, "version": "1"}
    moved = fold._step("b", 1, step)
    rule = TRANSITIONS[step]
    assert moved == (status in rule.sources)
    assert fold.blocks["b"]["status"] == (rule.target.value if moved else status.value)
    # and never across generations
    assert not Fold()._step("b", 2, step)
