"""`kill PID` (SIGTERM) of a `blocks agent` whose NATS is away stops it, exit 0 (docs/agents.md
"shutdown"): before, one that had never reached its NATS ignored the signal (only `kill -9`
stopped it), and one whose NATS had gone (its `blocks up` stopped or restarting) said 'Cannot
reach the servers: Connection lost' then 'agent failed: 2' and exited 1. The real CLI, on a real
nats-server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aios_blocks.runtime.embedded import EmbeddedServers

pytestmark = pytest.mark.integration


def _agent(tmp_path: Path, nats_url: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    env["AIOS_NATS_URL"] = nats_url
    return subprocess.Popen(
        [sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", "stop-n1", "--cluster", "stop-c",
         "--runtime", "sim", "--sim-gpus", "1", "--cpu", "2", "--memory", "1024", "--heartbeat-s", "0.5",
         "--agent-dir", str(tmp_path / "agent"), "--data-dir", str(tmp_path / "none")],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the agent did not stop on SIGTERM (killed): {err[-2000:]}")
    return proc.returncode, out, err


def _read_until(proc: subprocess.Popen[str], text: str, timeout: float = 60) -> str:
    """What the agent printed up to the line holding ``text`` (it must still run by then)."""
    deadline = time.monotonic() + timeout
    seen = ""
    assert proc.stdout is not None
    while text not in seen:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        seen += proc.stdout.readline()
    return seen


def test_an_agent_that_never_reached_its_nats_stops_on_sigterm(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _agent(tmp_path, f"nats://127.0.0.1:{port}")
    time.sleep(3)  # (it waits for its NATS: an agent may start before the control plane)
    assert proc.poll() is None, proc.communicate()
    code, out, err = _stop(proc)
    assert code == 0, err
    assert "stopped before NATS answered" in out + err


def test_an_agent_whose_nats_went_away_stops_on_sigterm_with_exit_0(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    try:
        proc = _agent(tmp_path, servers.nats_url)
        seen = _read_until(proc, "consumer.start")  # connected, taking commands
    finally:
        servers.stop()  # its NATS goes (a `blocks down`, a `blocks up` restarting)
    time.sleep(1.5)
    code, out, err = _stop(proc)
    assert "agent failed" not in err and "Cannot reach the servers" not in err, err
    assert code == 0, err
    assert '"agent.stop"' in seen + out


def test_an_agent_stops_on_sigterm_during_its_start_up_reconcile(tmp_path: Path) -> None:
    """No controller answers its start-up reconcile (it waits up to 15 s for one, then serves
    without it): a SIGTERM meanwhile stops it there, and it never starts taking commands. It used
    to wait the reconcile out, start its consumer, and only then see the signal."""
    servers = EmbeddedServers(data_dir=tmp_path / "data").start()
    try:
        proc = _agent(tmp_path, servers.nats_url)
        seen = _read_until(proc, '"agent.start"')  # connected, its reconcile under way (nobody answers it)
        code, out, err = _stop(proc)
    finally:
        servers.stop()
    assert code == 0, err
    assert "consumer.start" not in seen + out, seen + out
    assert "stopped during its start-up reconcile" in out + err
