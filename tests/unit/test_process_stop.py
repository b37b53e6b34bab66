"""The process runtime's stop (SIGTERM, then SIGKILL after the grace): a stop cut short (its agent
stopping mid-grace cancels it) never leaves the process it already told to stop running on, an
orphan of init until the next agent comes. Real processes, started and stopped here."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path

import psutil

from aios_blocks.agent.runtime import LaunchSpec
from aios_blocks.agent.runtime_process import ProcessRuntime

#: ignores SIGTERM (a side-car stuck where it does not look at it), saying so: 'up' once its handler
#: is set, 'term' for each SIGTERM it ignored
STUBBORN = [sys.executable, "-c", "import signal, time; "
            "signal.signal(signal.SIGTERM, lambda *_: print('term', flush=True)); print('up', flush=True); "
            "time.sleep(60)"]


def _words(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


async def _said(log: Path, word: str) -> None:
    """Until the process printed ``word`` on a line of its log (bounded)."""
    async with asyncio.timeout(30):
        while word not in _words(log):
            await asyncio.sleep(0.02)


async def test_a_stop_cancelled_mid_grace_kills_what_it_told_to_stop(tmp_path: Path) -> None:
    node = f"stop-{uuid.uuid4().hex[:8]}"
    rt = ProcessRuntime()
    log = tmp_path / "instance.log"
    inst = await rt.start(LaunchSpec(instance_id="sc-b-x-0", block_id="b", node_id=node, gen=1, command=STUBBORN,
                                     workdir=tmp_path))
    pid = int(inst.handle.split("-", 1)[0])
    try:
        await _said(log, "up")  # its SIGTERM handler is set
        stopping = asyncio.create_task(rt.stop(inst.handle, 30))
        await _said(log, "term")  # SIGTERMed, and ignoring it
        assert psutil.pid_exists(pid) and not stopping.done()  # within its grace
        stopping.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if [i for i in await rt.list(node) if i.running] == []:
                break
            await asyncio.sleep(0.05)
        assert [i for i in await rt.list(node) if i.running] == [], "the process outlived its cancelled stop"
    finally:
        for i in await ProcessRuntime().list(node):
            await rt.stop(i.handle, 0)
