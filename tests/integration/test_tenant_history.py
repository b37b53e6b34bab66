"""A tenant replays its own blocks' history (docs/security.md "Tenants", "History"): a request
``aios.block.B.history`` from its account, answered by the gateway's desk from the system stream,
page by page, with a default nats-py client. What it gets is exactly the stream's events of B that
are the tenant's own (never another tenant's refused create of the id, never an earlier owner's
block of the same id); another tenant's block is the 404 of a missing one; a tenant named in the
body changes nothing (the server's subject names the tenant)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest

from aios_blocks.runtime import auth
from aios_blocks.workers import tenants as desk

from .conftest import System
from .test_tenants import HEADERS, Seen, blocks, create, login, status

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True


async def ask(nc: nats.NATS, bid: str, **body: Any) -> tuple[int, dict[str, Any], str]:
    """One history request: (status, its JSON body, Aios-Error)."""
    reply = await nc.request(f"aios.block.{bid}.history", json.dumps(body).encode() if body else b"", timeout=30)
    return status(reply), msgspec.json.decode(reply.data), (reply.headers or {}).get("Aios-Error", "")


async def pages(nc: nats.NATS, bid: str, limit: int) -> tuple[list[dict[str, Any]], int]:
    """Every page from the first, following ``next`` while ``more``: (the events, pages asked)."""
    out: list[dict[str, Any]] = []
    start, n = 1, 0
    while True:
        code, page, err = await ask(nc, bid, **{"from": start, "limit": limit})
        assert code == 200, err
        n += 1
        assert len(page["events"]) <= limit and page["block_id"] == bid
        out += page["events"]
        if not page["more"]:
            return out, n
        assert page["next"] > start
        start = page["next"]


async def refused(*args: str) -> tuple[int, str]:
    """A ``blocks`` command expected to fail: (exit code, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    return int(proc.returncode or 0), err.decode()


async def system_view(system: System, bid: str) -> list[tuple[int, str, dict[str, Any]]]:
    """The system stream's events of ``bid`` as the admin's client reads them: (seq, subject, event)."""
    return [(seq, subject, env) for subject, env, seq in await system.client.history(bid, idle=0.3)
            if desk.relayed(subject) is not None]


async def test_a_tenant_replays_its_blocks_events_and_nothing_of_anothers(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("hc", nodes=1, gpus=4)
    for t in ("ha", "hb"):
        auth.add_tenant(system.data_dir, t)
    a, b = await login(system.data_dir, "ha"), await login(system.data_dir, "hb")
    seen_a, seen_b = Seen(), Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await b.subscribe("aios.block.>", cb=seen_b.on)
        await a.flush()
        await b.flush()
        ajs, bjs = a.jetstream(timeout=10), b.jetstream(timeout=10)
        await ajs.publish("aios.block.ha-b1.create", create("ha-b1"), headers=HEADERS)
        await seen_a.until("aios.block.ha-b1.ready")
        assert status(await a.request("aios.block.ha-b1.scale", b'{"target": 2}', timeout=30)) == 200
        async with asyncio.timeout(60):
            while len(await c.store.instances("ha-b1")) != 2:
                await asyncio.sleep(0.1)
        # B tries A's id: its submitted and rejected are stored under aios.block.ha-b1.>, and are B's
        b_ack = await bjs.publish("aios.block.ha-b1.create", create("ha-b1"), headers=HEADERS)
        await seen_b.until("aios.block.ha-b1.rejected")
        assert status(await a.request("aios.block.ha-b1.delete", b"", timeout=30)) == 200
        await seen_a.until("aios.block.ha-b1.deleted")

        stream = await system_view(system, "ha-b1")
        bs = [s for s, _, env in stream if env["data"].get("gen") == b_ack.seq]
        assert len(bs) == 2  # B's submitted and rejected
        expected = [(s, subj, env) for s, subj, env in stream if s not in bs]
        # one page: A's events, in the stream's order, each as the stream holds it
        code, page, _ = await ask(a, "ha-b1", limit=500)
        assert code == 200 and page["more"] is False
        got = [(e["seq"], e["subject"], e["event"]) for e in page["events"]]
        assert got == expected
        kinds = [subj.removeprefix("aios.block.ha-b1.") for _, subj, _ in got]
        assert kinds[0] == "submitted" and "ready" in kinds and "scale.target" in kinds and kinds[-1] == "deleted"
        assert "delete" in kinds and "rejected" not in kinds  # A's delete request is its; B's refusal is not
        assert all(e["event"]["data"].get("gen") != b_ack.seq for e in page["events"])
        # what the live relay gave A (the relay is core NATS: a publish that JetStream stored once,
        # its retry deduplicated, may have reached A twice; the history holds it once)
        live = {s for s in seen_a.subjects if desk.relayed(s) is not None}
        assert {subj for _, subj, _ in got} == live
        assert len(got) == len({subj_seq for subj_seq, _, _ in got})

        # pages of 3: the same events, in order, each once
        paged, n = await pages(a, "ha-b1", 3)
        assert paged == page["events"] and n >= len(expected) // 3
        # a page from a sequence: that event and the next ones
        mid = expected[len(expected) // 2][0]
        code, tail, _ = await ask(a, "ha-b1", **{"from": mid, "limit": 2})
        assert code == 200 and [e["seq"] for e in tail["events"]] == [s for s, _, _ in expected if s >= mid][:2]
        assert tail["more"] is True and tail["next"] > tail["events"][-1]["seq"]

        # B: A's block is a missing block, whatever B's body says
        missing = await ask(b, "hb-none")
        assert missing[0] == 404 and missing[2] == "tenant hb has no block hb-none"
        for body in ({}, {"tenant": "ha"}, {"tenant": "ha", "from": 1, "limit": 10}):
            code, answer, err = await ask(b, "ha-b1", **body)
            assert (code, err) == (404, "tenant hb has no block ha-b1"), (body, code, err)
            assert "events" not in answer
        # nor may B ask on the subject the desk serves in the system account (not B's to publish)
        errors: list[str] = []

        async def note(exc: Exception) -> None:
            errors.append(str(exc))

        b2 = await login(system.data_dir, "hb", error_cb=note)
        with pytest.raises(nats.errors.TimeoutError):
            await b2.request("aios.tenant.ha.block.ha-b1.history", b"", timeout=2)
        assert any("permissions violation for publish" in e.lower() for e in errors), errors
        await b2.close()
        # A naming B in its body still gets its own history, nothing else
        code, forged, _ = await ask(a, "ha-b1", tenant="hb", limit=500)
        assert code == 200 and forged["events"] == page["events"]
        # a body that is not a page: 400
        assert (await ask(a, "ha-b1", limit=0))[0] == 400
        assert (await ask(a, "ha-b1", **{"from": "x"}))[0] == 400

        # the tenant's command line: its credentials file, every page
        creds = {t: str(auth.credentials_path(system.data_dir, t, "main")) for t in ("ha", "hb")}
        out = json.loads(await blocks("tenant", "history", "ha-b1", "-c", creds["ha"], "--all", "--limit", "4", "--json"))
        assert out["events"] == page["events"] and out["more"] is False
        table = await blocks("tenant", "history", "ha-b1", "-c", creds["ha"], "--limit", "2")
        assert "submitted" in table and f"--from {expected[2][0]}" in table
        rc, err = await refused("tenant", "history", "ha-b1", "-c", creds["hb"])
        assert rc == 1 and "tenant hb has no block ha-b1" in err
    finally:
        await a.close()
        await b.close()


async def test_an_id_used_again_by_another_tenant_replays_only_the_new_owners_block(system: System) -> None:
    """A's block ``hx`` is deleted, B creates ``hx``: B's history of ``hx`` holds B's generation
    only (none of A's events, not A's delete request); A's asking is a 404."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("hr", nodes=1, gpus=2)
    for t in ("ra", "rb"):
        auth.add_tenant(system.data_dir, t)
    a, b = await login(system.data_dir, "ra"), await login(system.data_dir, "rb")
    seen_a, seen_b = Seen(), Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await b.subscribe("aios.block.>", cb=seen_b.on)
        await a.flush()
        await b.flush()
        a_ack = await a.jetstream(timeout=10).publish("aios.block.hx.create", create("hx"), headers=HEADERS)
        await seen_a.until("aios.block.hx.ready")
        assert status(await a.request("aios.block.hx.delete", b"", timeout=30)) == 200
        await seen_a.until("aios.block.hx.deleted")
        assert len((await ask(a, "hx"))[1]["events"]) > 3  # A's, while it was A's
        b_ack = await b.jetstream(timeout=10).publish("aios.block.hx.create", create("hx"), headers=HEADERS)
        await seen_b.until("aios.block.hx.ready")

        code, page, _ = await ask(b, "hx", limit=500)
        assert code == 200
        stream = await system_view(system, "hx")
        first_of_b = min(s for s, _, env in stream if env["data"].get("gen") == b_ack.seq)
        assert [(e["seq"], e["subject"], e["event"]) for e in page["events"]] == [x for x in stream if x[0] >= first_of_b]
        assert all(e["event"]["data"].get("gen") in (b_ack.seq, None) for e in page["events"])
        assert not any(e["event"]["data"].get("gen") == a_ack.seq for e in page["events"])
        assert (await ask(a, "hx"))[:1] == (404,)
    finally:
        await a.close()
        await b.close()


async def test_a_create_the_parser_refused_is_in_its_senders_history_only(system: System) -> None:
    """A tenant's create refused at parse leaves no block record with a spec (no owner label): its
    ``submitted`` and ``rejected`` are still its sender's history (it heard them live; found trying
    it as a stranger: the answer was a 404); another tenant asking gets the 404 of a missing block."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    for t in ("pa", "pb"):
        auth.add_tenant(system.data_dir, t)
    a, b = await login(system.data_dir, "pa"), await login(system.data_dir, "pb")
    seen_a = Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await a.flush()
        await a.jetstream(timeout=10).publish("aios.block.pa-bad.create", create("pa-bad", bogusField=1),
                                              headers=HEADERS)
        await seen_a.until("aios.block.pa-bad.rejected")
        code, page, err = await ask(a, "pa-bad", limit=500)
        assert code == 200, err
        kinds = [e["subject"].removeprefix("aios.block.pa-bad.") for e in page["events"]]
        assert kinds == ["submitted", "rejected"], kinds
        assert "bogusField" in json.dumps(page["events"][-1]["event"]["data"])  # the reason, as it heard it
        assert (await ask(b, "pa-bad"))[::2] == (404, "tenant pb has no block pa-bad")
    finally:
        await a.close()
        await b.close()
