"""What `blocks explain` and `blocks get` print, as a stranger following the README saw it."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.cli.render import _render_explain
from aios_blocks.projections.explain import explain


def _ev(kind: str, second: str, **data: Any) -> tuple[str, dict[str, Any]]:
    return f"aios.block.bx.{kind}", {"time": f"2026-11-25T20:00:{second}Z", "data": data}


def test_a_target_asked_without_a_reason_ends_its_line_without_a_dangling_colon(capsys: pytest.CaptureFixture[str]) -> None:
    # `blocks scale BID --to 2` sends no reason: explain printed "instance target 2 asked by cli 20:00:20: "
    x = explain([
        _ev("scale.target", "20", block_id="bx", request_id="cli-1", target=2, source="cli", reason=""),
        _ev("scale.target", "30", block_id="bx", request_id="rc-1", target=1, source="reconciler", reason="0 live < 1"),
    ])
    capsys.readouterr()
    _render_explain(x)
    lines = capsys.readouterr().out.splitlines()
    assert "instance target 2 asked by cli 20:00:20" in lines
    assert "instance target 1 asked by reconciler 20:00:30: 0 live < 1" in lines


def test_blocks_examples_describes_each_file_by_a_whole_sentence() -> None:
    # its first comment line alone ended mid-sentence: "... the Starlark twin of builtin:binpack:",
    # "... (written against", "... (RapidOCR; the ONNX models ship in the"
    from aios_blocks.cli.examples import EXAMPLES, _example_files, _example_note

    notes = {f.name: _example_note(f) for f in _example_files()}
    assert notes["binpack.star"].endswith("GPUs with the least free memory first (ties by a hash of the request).")
    assert notes["lxd_most_free_memory.star"].endswith("(written against the final API: instance_placement(request, candidate_members)).")
    assert notes["first_fit.py"] == "A resourceAllocator in the shape of seed 000's \"Example resource allocation policy structure\""
    commented = [f.name for f in _example_files() if (EXAMPLES / f.name).read_text().startswith("#")]
    assert len(commented) >= 8
    for name in commented:
        opened = notes[name].count("(") - notes[name].count(")")
        assert notes[name] and not notes[name].endswith((":", ",", " the")) and opened == 0, (name, notes[name])


def test_replay_rows_of_a_scale_target_and_a_scale_down_say_what_was_asked_and_chosen() -> None:
    # `blocks replay` printed bare "scale.target" and "scale_down.chosen" rows
    from aios_blocks.cli.render import _line

    target = _line("aios.block.bx.scale.target", {"data": {"block_id": "bx", "request_id": "r", "target": 2, "source": "cli"}})
    assert target.endswith(" target=2 by cli")
    asked = _line("aios.block.bx.scale.target",
                  {"data": {"block_id": "bx", "request_id": "r", "target": 1, "source": "reconciler", "reason": "0 live < 1"}})
    assert asked.endswith(" target=1 by reconciler: 0 live < 1")
    chosen = _line("aios.block.bx.scale_down.chosen", {"data": {"block_id": "bx", "gen": 1, "cluster_id": "c1", "request_id": "r",
                                                                "instance_id": "bx-3", "node_id": "n1", "chosen_by": "policy"}})
    assert chosen.endswith(" bx-3@n1 chosen by policy")


async def test_get_of_a_rejected_block_lists_its_spec_errors_one_per_line_without_an_empty_table(
        capsys: pytest.CaptureFixture[str]) -> None:
    # it printed `block b5: rejected ([{"path":"$.policyRulesSpec","message":"no clusterAllocator ..."}, ...])`
    # above an empty instance table
    from types import SimpleNamespace

    from aios_blocks.cli.render import _print_block
    from aios_blocks.testing import MemorySystem

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=1)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 3, "maxInstances": 2, "colour": 1})
        await s.run()
        capsys.readouterr()
        block = await _print_block(SimpleNamespace(store=s.store), bid)  # type: ignore[arg-type]
    assert block is not None and block["status"] == "rejected"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"block {bid}: rejected"
    assert "  $.minInstances: minInstances (3) is greater than maxInstances (2)" in lines
    assert "  $.colour: unknown field" in lines
    assert lines[-1] == "no instances"
    assert not any(line.startswith(("┏", "┃", "└")) for line in lines)  # no empty table


def test_explain_of_a_waiting_block_says_pending_with_its_reason_and_not_the_queue_s_key(capsys: pytest.CaptureFixture[str]) -> None:
    # explain's header said "block bx: parsed" (no reason) for a block waiting in the pending queue
    # (a tenant's explain has no pending-queue line: that was all it learnt), and its queue line
    # "waits in the pending queue _ at position 1 of 1": the primary queue's Redis key suffix
    from aios_blocks.cli.state import waiting_line

    why = "no cluster can hold minInstances (30) at once: c1 fits 20"
    waits = [_ev("submitted", "10", block_id="bx", gen=1, subject="aios.block.bx.create"),
             _ev("parsed", "11", block_id="bx", gen=1, ir={}),
             _ev("pending", "12", block_id="bx", gen=1, reason=why, reasons={"c1": why})]
    x = explain(waits)
    assert (x["status"], x["reason"]) == ("pending", why)
    capsys.readouterr()
    _render_explain(x)
    assert capsys.readouterr().out.splitlines()[0] == f"block bx: pending - {why}"
    # its next round, then its placement: the wait's reason goes with it
    again = explain([*waits, _ev("parsed", "20", block_id="bx", gen=1, ir={})])
    assert (again["status"], again["reason"]) == ("parsed", "")
    placed = explain([*waits, _ev("ready", "30", block_id="bx", gen=1, status="ready", instances=["bx-0"])])
    assert (placed["status"], placed["reason"]) == ("ready", "")

    line = {"reason": why, "scope": "_", "position": 1, "length": 1, "ahead": [], "preempted_by": "", "preempting": "",
            "since": 0.0, "deadline": 0.0}
    assert waiting_line(line) == f"waits in the pending queue at position 1 of 1 (behind nobody): {why}"  # type: ignore[arg-type]
    assert waiting_line({**line, "scope": "vc1", "position": 2, "length": 2, "ahead": ["b0"]}) == (  # type: ignore[arg-type]
        f"waits in the pending queue of virtual cluster vc1 at position 2 of 2 (behind b0): {why}")


def test_explain_counts_a_stored_policys_calls_under_its_uri_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    # explain's summary said "resourceAllocator:resourceAllocator@1" for registry:pol-raises@v1: the
    # version alone, not which policy
    def call(uri: str, version: int | None, action: str) -> dict[str, Any]:
        return {"block_id": "bx", "kind": "resourceAllocator", "policy": "resourceAllocator", "uri": uri, "version": version,
                "action": action, "input_digest": "d", "duration_us": 10, "error": ""}

    x = explain([_ev("allocation.failed", "10", block_id="bx", gen=1, step="allocation", reason="no",
                     decisions=[call("registry:packer", 2, "allocation"), call("builtin:binpack", None, "dry_run")])])
    assert sorted(x["decisions"]["by_policy"]) == ["resourceAllocator:resourceAllocator@builtin:binpack",
                                                   "resourceAllocator:resourceAllocator@registry:packer@v2"]
    capsys.readouterr()
    _render_explain(x)
    assert "  resourceAllocator:resourceAllocator@registry:packer@v2: 1 calls {'allocation': 1} 0.01 ms" in capsys.readouterr().out.splitlines()
