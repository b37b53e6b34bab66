"""`blocks agent` and `blocks worker` are daemons with a JSON log at AIOS_LOG_LEVEL (info by
default), like the workers `blocks up` runs: their info lines (`agent.start`, what each command
did) were dropped, because the CLI's runner set every command's library logs to warnings only after
the daemon had configured its own. Real processes, on the system fixture's servers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from .conftest import System


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)


async def _lines_until(path: Path, proc: subprocess.Popen[bytes], event: str) -> list[dict[str, object]]:
    async with asyncio.timeout(60):
        while True:
            lines = _lines(path)
            if any(x.get("event") == event for x in lines):
                return lines
            assert proc.poll() is None, lines
            await asyncio.sleep(0.1)


async def test_an_agent_and_a_worker_log_their_info_lines_as_json(system: System, tmp_path: Path) -> None:
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url,
           "AIOS_LOG_LEVEL": "info"}
    agent_env = {k: v for k, v in env.items() if k != "AIOS_REDIS_URL"}
    if system.servers is not None:
        agent_env.update(system.servers.agent_env("log-n0"))
    runs = {
        "agent.start": ([sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", "log-n0", "--cluster", "logs",
                         "--runtime", "process", "--agent-dir", str(tmp_path / "agent")], agent_env),
        "consumer.start": ([sys.executable, "-m", "aios_blocks.cli", "worker", "mapper"], env),
    }
    procs = []
    try:
        for event, (cmd, e) in runs.items():
            log = tmp_path / f"{event}.log"
            procs.append(p := _start(cmd, e, log))
            lines = await _lines_until(log, p, event)  # (an info line: it was never written)
            assert all(x.get("level") for x in lines), lines
            assert any(x.get("level") == "info" for x in lines), lines
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
