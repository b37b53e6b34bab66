"""A dead-lettered block create (``AIOS_INTAKE``) replayed with ``blocks dlq replay`` on the real
system (docs/dead-letters.md "A replayed create"): the parser takes the copy as a redelivery of the
create it is a copy of, at that create's generation (its publisher's PubAck ``seq``), not as a
new create at the copy's sequence. So a create that never made its block makes it once, at the
gen its publisher was told; one that made its record and failed before its ``parsed`` went out
goes on from there (it was answered "block id already in use" by its own record); and a replay
of a create whose block exists (``--force``, a second time) changes nothing: no second generation,
no ``rejected``, no second ``parsed``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.state.keys import block_key
from aios_blocks.state.tenants import pending_key

from .conftest import System
from .test_agent import until
from .test_dlq_replay import blocks
from .test_pending_queue import spec, status_of

pytestmark = pytest.mark.integration


async def _letter(system: System, subject: str) -> Any:
    """The parser's dead letter of the create on ``subject`` (after its 5 deliveries)."""
    from nats.js.errors import NotFoundError

    async def get() -> Any:
        try:
            return await system.client.bus.js.get_last_msg(subjects.STREAM, subjects.dead_letter(subjects.PARSER.durable, subject))
        except NotFoundError:
            return None

    return await until(get, 60, f"the dead letter of {subject}")


async def _dead_lettered_unmade(system: System, bid: str) -> tuple[Any, Any]:
    """A create of ``bid`` the parser dead-letters before it makes anything (the record's key is no
    hash: its script fails first, 5 deliveries), then the cause fixed: (its request, its letter)."""
    c = system.client
    await c.store.r.set(block_key(bid), "not a hash")
    req = await c.create(spec(bid))
    letter = await _letter(system, E.block_create.subject(bid=bid))
    assert "WRONGTYPE" in json.loads(letter.data)["data"]["error"]
    await c.store.r.delete(block_key(bid))  # the fix
    return req, letter


async def _taken(system: System) -> None:
    """Until the parser has handled every create in AIOS_INTAKE (its ack floor at the stream's end)."""
    js = system.client.bus.js

    async def done() -> bool:
        last = (await js.stream_info(subjects.STREAM_INTAKE)).state.last_seq
        info = await js.consumer_info(subjects.STREAM_INTAKE, subjects.PARSER.durable)
        return info.ack_floor.stream_seq >= last and info.num_ack_pending == 0

    await until(done, 60, "the parser to take every create")


async def _kinds(system: System, bid: str) -> list[str]:
    return [s.rsplit(".", 1)[1] for s, _e, _ in await system.client.history(bid, idle=0.3)]


async def test_a_replayed_create_makes_its_block_once_at_its_own_gen_and_a_replay_of_an_existing_one_changes_nothing(
        system: System) -> None:
    assert system.servers is not None
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=4)

    # 1. a create that never made its block: its record's key is no hash (its script fails before it
    # writes anything), 5 deliveries, dead-lettered
    req, letter = await _dead_lettered_unmade(system, "rc-new")
    rc, out, errs = await blocks(system.servers, "dlq", "replay", f"AIOS:{letter.seq}")
    assert rc == 0 and "replayed" in out, (out, errs)
    block = await status_of(system, "rc-new", "ready")
    # made once, at the gen its publisher's PubAck said (not the copy's sequence)
    assert int(block["gen"]) == req.seq, (block["gen"], req.seq)
    kinds = await _kinds(system, "rc-new")
    assert kinds.count("parsed") == 1 and "rejected" not in kinds, kinds
    # the block's replay shows its dead letter in its place, not a gap between submitted and parsed
    rc, out, errs = await blocks(system.servers, "replay", "rc-new")
    rows = [ln.split()[2:4] for ln in out.splitlines()[1:] if ln.split() and ln.split()[0].isdigit()]
    assert rc == 0 and rows[:3] == [["rc-new", "submitted"], ["rc-new", "dlq.create"], ["rc-new", "parsed"]], (out, errs)
    assert "dead letter: parser gave up after 5 deliveries: ResponseError" in " ".join(out.split()), out

    # a replay of it again (--force) once the block exists: nothing changes, nor once the stream's
    # duplicate window (2 minutes) no longer drops what the replay's events would repeat
    info = await c.bus.js.stream_info(subjects.STREAM)
    info.config.duplicate_window = 0.5
    await c.bus.js.update_stream(info.config)
    await asyncio.sleep(1.0)
    rc, out, errs = await blocks(system.servers, "dlq", "replay", f"AIOS:{letter.seq}", "--force")
    assert rc == 0 and "attempt 2" in out, (out, errs)
    await _taken(system)
    after = await c.store.get_block("rc-new")
    assert after is not None and int(after["gen"]) == req.seq and after["status"] == "ready", after
    kinds = await _kinds(system, "rc-new")
    assert kinds.count("parsed") == 1 and "rejected" not in kinds, kinds

    # 2. a create that made its record and failed after it (a tenant's: its pending set is no set),
    # so its parsed never went out: the block waits at parsed
    await c.store.r.set(pending_key("acme"), "not a set")
    body = json.dumps(spec("rc-part")).encode()
    ack = await c.bus.js.publish(E.tenant_block_create.subject(tenant="acme", bid="rc-part"), body,
                                 headers={"Nats-Msg-Id": "rc-part-1", "Content-Type": "application/json"})
    letter = await _letter(system, E.tenant_block_create.subject(tenant="acme", bid="rc-part"))
    stuck = await c.store.get_block("rc-part")
    assert stuck is not None and stuck["status"] == "parsed" and int(stuck["gen"]) == ack.seq, stuck
    await c.store.r.delete(pending_key("acme"))  # the fix
    rc, out, errs = await blocks(system.servers, "dlq", "replay", f"AIOS:{letter.seq}")
    assert rc == 0, out
    block = await status_of(system, "rc-part", "ready")
    assert int(block["gen"]) == ack.seq, block["gen"]
    kinds = await _kinds(system, "rc-part")
    assert kinds.count("parsed") == 1 and "rejected" not in kinds, kinds
    # the state rebuilt from the stream is Redis's: the fold took each replayed create as the live parser did
    rc, out, errs = await blocks(system.servers, "check", "--json")
    assert rc == 0, out


async def test_a_replayed_create_whose_original_left_the_intake_keeps_its_gen_by_its_letter(system: System) -> None:
    """Once the stream's limits dropped a dead-lettered create from ``AIOS_INTAKE`` (its record never
    made), its replay still makes the block at the gen its publisher was told: the parser reads the
    letter the copy names. A copy naming that letter for another block is not that create."""
    assert system.servers is not None
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=4)
    req, letter = await _dead_lettered_unmade(system, "rc-gone")
    await c.bus.js.delete_msg(subjects.STREAM_INTAKE, req.seq)  # as the intake's age or size limit drops it

    # a create of another block claiming that letter and that gen: its own gen
    other = await c.bus.js.publish(E.block_create.subject(bid="rc-other"), json.dumps(spec("rc-other")).encode(),
                                   headers={"Nats-Msg-Id": "rc-other-1", "Content-Type": "application/json",
                                            "Aios-Replay-Of": f"AIOS:{letter.seq}", "Aios-Replay-Seq": str(req.seq)})
    block = await status_of(system, "rc-other", "ready")
    assert int(block["gen"]) == other.seq != req.seq, (block["gen"], other.seq)

    rc, out, errs = await blocks(system.servers, "dlq", "replay", f"AIOS:{letter.seq}")
    assert rc == 0 and "replayed" in out, (out, errs)
    block = await status_of(system, "rc-gone", "ready")
    assert int(block["gen"]) == req.seq, (block["gen"], req.seq)  # not the copy's sequence
    kinds = await _kinds(system, "rc-gone")
    assert kinds.count("parsed") == 1 and "rejected" not in kinds, kinds


async def test_submit_wait_of_a_create_the_parser_dead_letters_ends_at_the_letter_and_names_the_replay(
        system: System, tmp_path: Any) -> None:
    """`blocks submit --wait` of a create the parser gave up on waited out its timeout (120 s) and
    said only "timed out" (exit 5): it now ends when the letter is stored, says who gave up after
    how many deliveries and why, and the replay command (exit 3, failed with the reason)."""
    assert system.servers is not None
    c = system.client
    await c.add_sim_cluster("c1", nodes=1, gpus=4)
    await c.store.r.set(block_key("rc-wait"), "not a hash")
    spec_file = tmp_path / "b.json"
    spec_file.write_text(json.dumps(spec("rc-wait")))
    rc, out, errs = await blocks(system.servers, "submit", str(spec_file), "--wait", "--timeout", "100")
    said = " ".join(errs.split())
    assert rc == 3 and "dead-lettered: parser gave up on this create after 5 deliveries" in said, (out, errs)
    assert "WRONGTYPE" in said and "once the cause is fixed: blocks dlq replay AIOS:" in said, (out, errs)
    letter = said.rsplit("blocks dlq replay ", 1)[1].split()[0]
    await c.store.r.delete(block_key("rc-wait"))  # the fix, then the replay it named
    rc, out, errs = await blocks(system.servers, "dlq", "replay", letter)
    assert rc == 0, (out, errs)
    await status_of(system, "rc-wait", "ready")
