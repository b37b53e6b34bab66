"""The fold rebuilds priority classes and quotas from their events (issue 36): what
``state.priority.PriorityStore`` writes, one default class, removals."""

from __future__ import annotations

import msgspec

from aios_blocks.recovery.fold import Fold
from aios_blocks.state import keys

from .test_recovery_fold import run


def test_classes_and_quotas_fold_into_their_hashes() -> None:
    f = Fold()
    run(f, [
        ("aios.priorityclass.normal.registered", {"name": "normal", "record": {"name": "normal", "value": 100, "default": True}}),
        ("aios.priorityclass.batch.registered", {"name": "batch", "record": {"name": "batch", "value": 0, "default": True}}),
        ("aios.priorityclass.tmp.registered", {"name": "tmp", "record": {"name": "tmp", "value": 5, "default": False}}),
        ("aios.priorityclass.tmp.removed", {"name": "tmp"}),
        ("aios.quota.team-a.set", {"name": "team-a", "record": {"tenant": "team-a", "cohort": "lab", "nominal": {"*": {"gpus": 2.0}}}}),
        ("aios.quota.gone.set", {"name": "gone", "record": {"tenant": "gone", "nominal": {}}}),
        ("aios.quota.gone.set", {"name": "gone", "record": None}),
    ])
    img = f.image()
    classes = {k: msgspec.json.decode(v) for k, v in img[keys.PRIORITY_CLASSES].items()}
    assert classes == {"normal": {"name": "normal", "value": 100, "default": False},
                       "batch": {"name": "batch", "value": 0, "default": True}}
    assert set(img[keys.QUOTAS]) == {"team-a"}


def test_the_pending_queue_folds_from_its_events() -> None:
    """block.pending -> pending (with its reason, since, deadline, the victim's preemptor) and in
    the queue's scratch keys; block.preempting marks the preemptor; a retry (parsed, attempt 1)
    takes it back to parsed and out of the queue; an expiry (failed) too."""
    from aios_blocks.state import queue

    ir = {"blockId": "b", "minInstances": 1, "maxInstances": 1, "priority": 7}
    f = Fold()
    run(f, [
        ("aios.block.b.parsed", {"block_id": "b", "gen": 1, "ir": ir, "attempt": 0}),
        ("aios.block.b.selection", {"block_id": "b", "gen": 1, "candidates": [], "filtered": {"c1": "full"}, "rule": "r"}),
        ("aios.block.b.pending", {"block_id": "b", "gen": 1, "reason": "full", "reasons": {"c1": "full"}, "priority": 7,
                                  "since": 12.5, "deadline": 72.5}),
        ("aios.block.b.preempting", {"block_id": "b", "gen": 1, "reason": "Priority", "request_id": "r1"}),
        ("aios.block.c.parsed", {"block_id": "c", "gen": 2, "ir": {**ir, "blockId": "c", "priority": 0}, "attempt": 0}),
        ("aios.block.c.selection", {"block_id": "c", "gen": 2, "candidates": [], "filtered": {}, "rule": "r"}),
        ("aios.block.c.pending", {"block_id": "c", "gen": 2, "reason": "full", "since": 10.0, "deadline": 0.0,
                                  "preempted_by": "x"}),
    ])
    b, c = f.blocks["b"], f.blocks["c"]
    assert (b["status"], b["reason"], b["pending_since"], b["pending_deadline"], b["preempting"]) == (
        "pending", "full", "12.500", "72.500", "r1")
    assert (c["status"], c["preempted_by"]) == ("pending", "x")
    img = f.image()
    assert img[queue.queue_key("_")] == {queue.member("b", 12.5): -7.0, queue.member("c", 10.0): 0.0}
    assert img[queue.DUE] == {"b": 72.5}
    run(f, [("aios.block.b.parsed", {"block_id": "b", "gen": 1, "ir": ir, "attempt": 1}),
            ("aios.block.c.failed", {"block_id": "c", "gen": 2, "status": "failed", "reason": "waited longer"})])
    assert (f.blocks["b"]["status"], f.blocks["b"]["attempt"], f.blocks["b"]["preempting"]) == ("parsed", "1", "")
    assert f.blocks["c"]["status"] == "failed"
    assert queue.queue_key("_") not in f.image()


def _wait_then_retry(wait_from: str, pending_first: bool) -> Fold:
    """Block b waits (from ``wait_from``: the gateway's selecting, the controller's allocating)
    and the walker retries it; ``pending_first``: its block.pending stored before the retry's
    parsed (Redis's order), else after (the walker's retry published before the wait's pending
    was acked: stream seq 910 parsed, 912 pending)."""
    ir = {"blockId": "b", "minInstances": 1, "maxInstances": 1}
    head: list[tuple[str, object]] = [
        ("aios.block.b.parsed", {"block_id": "b", "gen": 1, "ir": ir, "attempt": 0}),
        ("aios.block.b.selection", {"block_id": "b", "gen": 1, "candidates": ["c1"], "rule": "r", "deadline": 5.0}),
    ]
    if wait_from == "allocating":
        head.append(("aios.block.b.post_dry_run", {"block_id": "b", "gen": 1, "cluster_id": "c1", "scores": {"c1": 1}}))
    pending = ("aios.block.b.pending", {"block_id": "b", "gen": 1, "reason": "full", "reasons": {"c1": "full"},
                                        "since": 12.5, "deadline": 72.5, "attempt": 0})
    retry = ("aios.block.b.parsed", {"block_id": "b", "gen": 1, "ir": ir, "attempt": 1})
    f = Fold()
    run(f, [*head, *([pending, retry] if pending_first else [retry, pending])])
    assert f.blocks["b"]["status"] == "parsed"
    run(f, [("aios.block.b.selection", {"block_id": "b", "gen": 1, "candidates": ["c1"], "rule": "r", "attempt": 1,
                                        "deadline": 9.0})])
    return f


def test_a_retry_stored_before_the_pending_it_ended_folds_as_redis_took_them() -> None:
    """The walker's retry (parsed, attempt 1) stored before the block.pending of the wait it
    ended: the fold ends where Redis did (WAIT then RETRY: pending_since/deadline kept, reason and
    preempting cleared, selecting again at attempt 1), as with the events in Redis's order; a
    duplicate of the late pending changes nothing. Was: from allocating the pending was refused
    (no pending_since/deadline, reason, preempting: ``blocks check`` reported it for ever); from
    selecting the retry was refused and the block stuck pending in the fold."""
    from aios_blocks.recovery.image import digest

    for wait_from in ("allocating", "selecting"):
        ordered, late = _wait_then_retry(wait_from, True), _wait_then_retry(wait_from, False)
        want = {f: v for f, v in ordered.blocks["b"].items() if f != "version"}
        assert (want["status"], want["attempt"], want["pending_since"], want["pending_deadline"], want["reason"],
                want["preempting"]) == ("selecting", "1", "12.500", "72.500", "", "")
        assert {f: v for f, v in late.blocks["b"].items() if f != "version"} == want, wait_from
        assert digest(late.image()) == digest(ordered.image()), wait_from
        run(late, [("aios.block.b.pending", {"block_id": "b", "gen": 1, "reason": "full", "since": 12.5,
                                             "deadline": 72.5, "attempt": 0})])
        assert {f: v for f, v in late.blocks["b"].items() if f != "version"} == want, wait_from
