"""A tenant observes its own blocks with its credentials file (docs/security.md "Tenants",
"Observing"): ``blocks explain B -c CREDS`` and ``blocks watch [B] -c CREDS [--since SEQ]`` go
through the gateway's tenant desk (its history pages) and the relay, never the system stream; for
another tenant's block they are refused as for a missing one, with nothing of it printed. The
relay is core NATS and may pass one stored event on twice (a step redelivered and published
again): a tenant's watch shows each event once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus import history
from aios_blocks.runtime import auth
from aios_blocks.runtime import tenants as tn

from .conftest import System
from .test_tenants import HEADERS, Seen, blocks, create, login, status

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True


async def run(*args: str) -> tuple[int, str, str]:
    """A ``blocks`` command that ends: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    return int(proc.returncode or 0), out.decode(), err.decode()


class Watch:
    """A ``blocks watch`` running as a subprocess: its output lines as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc, self.lines = proc, list[str]()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.lines.append(line.decode().rstrip("\n"))

    def kinds(self, bid: str) -> list[str]:
        """Each line's event, as ``watch`` names it (the word after the block id)."""
        return [ln.split(bid, 1)[1].split()[0] for ln in self.lines if f" {bid} " in f" {ln} "]

    def count(self, word: str, bid: str) -> int:
        """Lines of event ``word`` (``added``: any instance's ``instance.I.added``)."""
        return sum(k == word or k.endswith(f".{word}") for k in self.kinds(bid))

    async def until(self, word: str, bid: str, n: int = 1, timeout: float = 120) -> None:
        async with asyncio.timeout(timeout):
            while self.count(word, bid) < n:
                if self._reader.done():
                    raise AssertionError(f"watch ended: {self.lines}")
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def watching(*args: str) -> AsyncIterator[Watch]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), "watch", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    w = Watch(proc)
    try:
        yield w
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(w._reader, 5)


async def stored_event(system: System, subject: str) -> bytes:
    """The stored message of ``subject`` (the system's stream), as the relay passed it on."""
    m = await system.client.bus.js.get_last_msg("AIOS", subject)
    return bytes(m.data)


async def relay_again(system: System, tenant: str, subject: str, data: bytes) -> None:
    """What the relay does when a stored event reaches it twice: the same message once more."""
    await system.client.bus.nc.publish(tn.event_subject(tenant, subject), data)
    await system.client.bus.nc.flush()


@pytest.mark.timeout(600)  # a dozen `blocks` commands: 10-20 s each on a loaded 2-core box
async def test_a_tenant_explains_and_watches_its_block_and_nothing_of_anothers(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("oc", nodes=1, gpus=4)
    for t in ("oa", "ob"):
        auth.add_tenant(system.data_dir, t)
    creds = {t: str(auth.credentials_path(system.data_dir, t, "main")) for t in ("oa", "ob")}
    a = await login(system.data_dir, "oa")
    seen_a = Seen()
    try:
        await a.subscribe("aios.block.>", cb=seen_a.on)
        await a.flush()
        await a.jetstream(timeout=10).publish("aios.block.oa-1.create", create("oa-1"), headers=HEADERS)
        await seen_a.until("aios.block.oa-1.ready")

        # explain, as the tenant: the same story the admin's explain tells of the block
        mine = json.loads(await blocks("explain", "oa-1", "-c", creds["oa"], "--json"))
        admin = json.loads(await blocks("explain", "oa-1", "--json", "--data-dir", str(system.data_dir)))
        assert mine["status"] == "ready" and len(mine["instances"]) == 1 and mine["rounds"]
        assert mine == {k: v for k, v in admin.items() if k != "pending"}  # no pending queue: Redis, not its
        text = await blocks("explain", "oa-1", "-c", creds["oa"])
        assert "block oa-1" in text and "ready" in text
        # as tenant B (A's block, a missing one alike: refused, nothing printed), --inputs, --since for all
        cases = {(*args, bid): (1, "", f"tenant ob has no block {bid}") for bid in ("oa-1", "ob-none")
                 for args in (("explain", "-c", creds["ob"]), ("explain", "--json", "-c", creds["ob"]),
                              ("watch", "--since", "1", "-c", creds["ob"]))}
        cases[("explain", "-c", creds["oa"], "--inputs", "oa-1")] = (2, "", "error: --inputs replays the whole system "
                                                                           "stream: not for a tenant (-c)")
        cases[("watch", "-c", creds["ob"], "--since", "1")] = (2, "", "error: --since needs a block id: a tenant's "
                                                                      "history is asked block by block")
        three = asyncio.Semaphore(3)  # at once: each is a Python start-up, slow on a loaded box

        async def one(args: tuple[str, ...]) -> tuple[int, str, str]:
            async with three:
                return await run(*args)

        answers = await asyncio.gather(*(one(args) for args in cases))
        for (args, expected), (rc, out, err) in zip(cases.items(), answers, strict=True):
            assert (rc, out, " ".join(err.split())) == expected, args

        # watch from the start, as the tenant: its history, then live; B watches A's block live
        async with watching("oa-1", "-c", creds["oa"], "--since", "1") as w, \
                watching("oa-1", "-c", creds["ob"]) as wb, watching("-c", creds["ob"]) as wb_all:
            await w.until("ready", "oa-1")
            before = list(w.kinds("oa-1"))
            page = await history.ask_all_history(a, "oa-1")
            assert before[:len(page["events"])] == [e["subject"].split(".", 3)[3] for e in page["events"]]
            assert before.count("submitted") == 1 and before.count("ready") == 1
            # live: a scale, as the tenant asks it
            assert status(await a.request("aios.block.oa-1.scale", b'{"target": 2}', timeout=30)) == 200
            await w.until("scale.target", "oa-1")
            await w.until("added", "oa-1", n=2)
            # the relay passing the stored ready and the scale again (at-least-once): shown once
            for subject in ("aios.block.oa-1.ready", "aios.block.oa-1.scale.target"):
                await relay_again(system, "oa", subject, await stored_event(system, subject))
            assert status(await a.request("aios.block.oa-1.delete", b"", timeout=30)) == 200
            await w.until("deleted", "oa-1")
            assert seen_a.subjects.count("aios.block.oa-1.ready") == 2  # the wire carried it twice
            kinds = Counter(w.kinds("oa-1"))
            assert kinds["ready"] == 1 and kinds["scale.target"] == 1 and kinds["deleted"] == 1, w.lines
            assert kinds["delete"] == 1  # the delete request's stored event, not the request itself
        assert wb.lines == [] and wb_all.lines == []  # B: not a line of A's block
        # the admin's watch --since: the system stream from seq 1 (then live)
        async with watching("oa-1", "--since", "1", "--data-dir", str(system.data_dir)) as admin_w:
            await admin_w.until("deleted", "oa-1")
        assert admin_w.count("submitted", "oa-1") == 1 and admin_w.count("ready", "oa-1") == 1
    finally:
        await a.close()


async def test_a_tenants_follow_shows_each_relayed_event_once(system: System) -> None:
    """``bus.history.follow`` with a nats-py client in its default configuration: history from a
    sequence, then live, where the relay delivers an event twice and a new one once."""
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("fc", nodes=1, gpus=2)
    auth.add_tenant(system.data_dir, "fa")
    a = await login(system.data_dir, "fa")
    raw = Seen()
    got: list[tuple[int | None, str, dict[str, Any]]] = []

    async def collect() -> None:
        async for item in history.follow(a, "fa-1", since=1):
            got.append(item)

    task: asyncio.Task[None] | None = None
    try:
        await a.subscribe("aios.block.fa-1.>", cb=raw.on)
        await a.flush()
        await a.jetstream(timeout=10).publish("aios.block.fa-1.create", create("fa-1"), headers=HEADERS)
        await raw.until("aios.block.fa-1.ready")
        task = asyncio.create_task(collect())
        async with asyncio.timeout(60):
            while "aios.block.fa-1.ready" not in [s for _, s, _ in got]:
                await asyncio.sleep(0.05)
        assert all(seq is not None for seq, _, _ in got)  # from the history pages so far
        ready = await stored_event(system, "aios.block.fa-1.ready")
        await relay_again(system, "fa", "aios.block.fa-1.ready", ready)
        await relay_again(system, "fa", "aios.block.fa-1.ready", ready)
        # a new event (its own id) after the repeats: once, live
        marker = msgspec.json.decode(ready)
        marker["id"] = "fa-1:marker"
        await relay_again(system, "fa", "aios.block.fa-1.ready", msgspec.json.encode(marker))
        async with asyncio.timeout(30):
            while not any(e.get("id") == "fa-1:marker" for _, _, e in got):
                await asyncio.sleep(0.05)
        assert raw.subjects.count("aios.block.fa-1.ready") == 4  # the wire: once live, twice again, the marker
        readies = [(seq, e["id"]) for seq, s, e in got if s == "aios.block.fa-1.ready"]
        assert [i for _, i in readies] == [msgspec.json.decode(ready)["id"], "fa-1:marker"], readies
        assert readies[0][0] is not None and readies[1][0] is None  # the history's, then the live one
        ids = [(s, e["id"]) for _, s, e in got]
        assert len(ids) == len(set(ids))
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await a.close()
