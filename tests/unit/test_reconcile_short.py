"""A ready block short of its minimum that nothing can replace is *short*, a condition beside its
status (``handlers.reconcile.decide``, ``schemas.condition``; docs/reliability.md "Short blocks"):
set once the reconciler's ask placed nothing, announced once per spell (``block.degraded``),
cleared and announced once when it is whole again (``block.restored``), never while it is whole."""

from __future__ import annotations

from typing import Any

import msgspec

from aios_blocks.handlers import reconcile as rc
from aios_blocks.schemas import condition as cond
from aios_blocks.state.views import status_text

BACKOFF = rc.Backoff(base_s=2.0, cap_s=8.0)


def block(status: str = "ready", lo: int = 1, short: cond.BlockShort | None = None, gen: int = 4, **insts: str) -> rc.BlockSize:
    return rc.BlockSize("b", gen, status, "c1", lo, 3, 0, {iid: {"status": s, "node": "n1"} for iid, s in insts.items()}, short)


class World:
    """The reconciler's passes over one block, carrying its memory and its record's mark as the
    worker does (the mark written after the pass, cleared when unmarked)."""

    def __init__(self) -> None:
        self.memory: dict[str, rc.Memory] = {}
        self.mark: cond.BlockShort | None = None
        self.degraded: list[cond.BlockShort] = []
        self.restored: list[cond.BlockShort] = []

    def run(self, t: float, notes: dict[str, rc.Note] | None = None, **kw: Any) -> rc.Outcome:
        out = rc.decide([block(short=self.mark, **kw)], self.memory, t, BACKOFF, notes)
        self.memory = out.memory
        self.mark = out.marks.get("b", self.mark)
        if any(bid == "b" for bid, _ in out.unmark):
            self.mark = None
        self.degraded += out.degraded
        self.restored += out.restored
        return out


def test_a_whole_block_is_never_marked_nor_announced() -> None:
    w = World()
    for t in range(0, 100, 5):
        out = w.run(float(t), **{"b-0": "running", "b-1": "starting"}, lo=2)
        assert (out.degraded, out.restored, out.marks, out.unmark) == ([], [], {}, [])
    assert w.mark is None


def test_short_once_the_ask_placed_nothing_then_whole_again_once() -> None:
    w = World()
    first = w.run(100.0)  # 0 live < 1: the first ask; it may still place the block, so not short yet
    assert first.asks and not first.degraded and w.mark is None
    note = {"b": rc.Note(4, "scale", "no healthy node can host an instance", 100.5)}
    second = w.run(100.6, note)  # still short after the ask: short, announced
    (d,) = second.degraded
    assert (d.block_id, d.gen, d.live, d.min_instances, d.since) == ("b", 4, 0, 1, 100.0)
    assert d.reason == "scale failed: no healthy node can host an instance" and d.episode == "100000"
    assert w.mark == d and w.memory["b"].degraded
    assert status_text("ready", cond.encode(d)).startswith("ready (short 0/1 since ")
    # while it stays short: asks go on with their backoff, no second announcement
    for t in (101.0, 102.5, 106.0, 115.0, 130.0):
        assert not w.run(t, note).degraded
    assert len(w.degraded) == 1
    # room again: an instance starts (it counts); restored once, the mark goes
    back = w.run(131.0, **{"b-1": "starting"})
    (r,) = back.restored
    assert (r.live, r.since, r.episode) == (1, 100.0, d.episode) and "after 31 s" in r.reason
    assert w.mark is None and back.unmark == [("b", 4)] and "b" in back.dropped
    for t in (132.0, 140.0):
        out = w.run(t, **{"b-1": "running"})
        assert (out.degraded, out.restored, out.unmark) == ([], [], [])
    assert (len(w.degraded), len(w.restored)) == (1, 1)


def test_a_block_replaced_at_once_is_never_short() -> None:
    """Short at one pass (the reconciler asks), whole at the next: the ask placed it, no event."""
    w = World()
    assert w.run(10.0, lo=2, **{"b-0": "running"}).asks
    out = w.run(10.4, lo=2, **{"b-0": "running", "b-1": "starting"})
    assert (w.degraded, w.restored, out.marks, w.mark) == ([], [], {}, None)


def test_the_mark_follows_the_figures_and_reason_silently() -> None:
    w = World()
    w.run(0.0, lo=2)
    w.run(0.5, lo=2)
    assert w.mark is not None and (w.mark.live, w.mark.min_instances) == (0, 2)
    assert "the reconciler's ask for 2 placed nothing yet" in w.mark.reason
    out = w.run(3.0, {"b": rc.Note(4, "reassignment", "no room", 2.9)}, lo=2, **{"b-0": "running"})
    assert out.degraded == [] and w.mark.live == 1 and w.mark.running == 1 and w.mark.reason == "reassignment failed: no room"
    assert w.mark.since == 0.0 and len(w.degraded) == 1


def test_a_note_of_another_generation_or_long_before_the_spell_is_not_its_reason() -> None:
    w = World()
    w.run(100.0)
    w.run(100.5, {"b": rc.Note(3, "scale", "old gen", 100.2)})
    assert w.mark is not None and "placed nothing yet" in w.mark.reason
    w.run(103.0, {"b": rc.Note(4, "scale", "an hour ago", 100.0 - 3600)})
    assert "placed nothing yet" in w.mark.reason
    # the reassignment that failed just before the block was seen short is its reason
    w.run(104.0, {"b": rc.Note(4, "reassignment", "no healthy node", 98.0)})
    assert w.mark.reason == "reassignment failed: no healthy node"


def test_announced_once_even_when_the_memory_or_the_mark_is_lost() -> None:
    w = World()
    w.run(0.0)
    w.run(0.5)
    assert len(w.degraded) == 1
    w.memory = {}  # the memory lost (Redis failover): the mark says it was announced
    assert not w.run(1.0).degraded and w.mark is not None and w.mark.since == 0.0
    w.mark = None  # the mark lost (blocks recover rebuilt the record): the memory says so; written again
    out = w.run(2.5)
    assert not out.degraded and "b" in out.marks and w.mark is not None
    w.mark = None  # whole with the mark gone: the memory's word ends the spell
    out = w.run(3.0, **{"b-0": "running"})
    assert len(out.restored) == 1 and len(w.degraded) == 1


def test_a_block_that_left_ready_loses_its_mark_without_an_event() -> None:
    w = World()
    w.run(0.0)
    w.run(0.5)
    mark, memory = w.mark, w.memory
    assert mark is not None
    for status in ("pending", "deleting", "deleted"):
        w.mark, w.memory = mark, memory
        out = w.run(1.0, status=status)
        assert out.unmark == [("b", 4)] and (out.degraded, out.restored, out.asks) == ([], [], [])
        assert out.dropped == ["b"] and w.mark is None


def test_the_events_ids_name_the_spell() -> None:
    s = cond.BlockShort("b", 4, 0, 0, 1, 100.0, "x", rc.episode(100.0))
    from aios_blocks.schemas.catalog import E

    assert E.block_degraded.msg_id(s, {"bid": "b"}) == "b:4:degraded:100000"
    assert E.block_restored.msg_id(s, {"bid": "b"}) == "b:4:restored:100000"


def test_status_text() -> None:
    s = cond.BlockShort("b", 4, 0, 0, 1, 0.0, "scale failed: no healthy node", "0")
    assert status_text("ready", cond.encode(s)) == "ready (short 0/1 since 00:00:00: scale failed: no healthy node)"
    assert status_text("ready", None) == "ready"
    assert status_text("deleting", cond.encode(s)) == "deleting"  # a stale mark is not shown
    assert status_text("ready", "not json") == "ready"
    assert cond.decode(cond.encode(s)) == s and cond.decode("not json") is None


def test_the_fold_keeps_the_mark_its_events_give_and_the_digest_leaves_it_out() -> None:
    """``blocks recover`` and the console read the fold: degraded sets the record's mark, restored
    or a step that leaves ready clears it; Redis's mark (the reconciler's figures) is not digested."""
    from aios_blocks.recovery import image as im

    from .test_recovery_fold import placed, run

    f = placed()
    s = cond.BlockShort("b1", 2, 0, 0, 1, 100.0, "scale failed: no room", "100000")
    data = msgspec.structs.asdict(s)
    run(f, [("aios.block.b1.degraded", data)])
    assert cond.decode(f.image()["aios:block:b1"]["short"]) == s
    before = f.image()
    redis = {**before, "aios:block:b1": {**before["aios:block:b1"], "short": cond.encode(cond.BlockShort("b1", 2, 0, 0, 1, 100.0, "newer"))}}
    assert im.digest(redis) == im.digest(before)
    run(f, [("aios.block.b1.restored", {**data, "live": 1})])
    assert "short" not in f.image()["aios:block:b1"]
    run(f, [("aios.block.b1.degraded", {**data, "gen": 1})])  # another generation's: nothing
    assert "short" not in f.image()["aios:block:b1"]
    run(f, [("aios.block.b1.degraded", data), ("aios.block.b1.delete", {"block_id": "b1", "request_id": "d"})])
    assert f.image()["aios:block:b1"]["status"] == "deleting" and "short" not in f.image()["aios:block:b1"]
