"""`blocks up` starts again an embedded server that dies, on its port with its data. Found by a
stranger's pass: after a `kill -9` of the nats-server (or redis-server) that `blocks up` started,
nothing restarted it and nothing said so; the workers logged "connection refused" for ever and
every `blocks` command exited 2. Driven as a user does (`blocks up` in a subprocess, real servers)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import COMPONENT
from .test_lifecycle import Up, _env, wait_gone

pytestmark = pytest.mark.integration


def _server_pid(up: Up, program: str) -> int | None:
    for pid in up.descendants():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == program:  # (redis-server rewrites its argv)
                return pid
        except OSError:
            continue
    return None


def _wait_for(what: str, up: Up, cond: object, within: float = 60.0) -> None:
    deadline = time.time() + within
    while not cond():  # type: ignore[operator]
        assert up.proc.poll() is None, f"blocks up exited {up.proc.returncode} waiting for {what}:\n{up.worker_logs()}"
        assert time.time() < deadline, f"no {what} within {within} s:\n{up.worker_logs()}"
        time.sleep(0.2)


@pytest.fixture
def specs(tmp_path: Path) -> Iterator[dict[str, Path]]:
    comp = tmp_path / "component.json"
    comp.write_text(json.dumps(COMPONENT))
    out = {"component": comp}
    for bid in ("before", "after-nats", "after-redis"):
        spec = tmp_path / f"{bid}.json"
        spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": bid,
                                    "minInstances": 1, "maxInstances": 1}))
        out[bid] = spec
    yield out


def test_a_killed_embedded_server_is_started_again_on_its_port_and_nothing_is_lost(tmp_path: Path,
                                                                                   specs: dict[str, Path]) -> None:
    data = tmp_path / "data"
    up = Up(data, _env())
    try:
        for args in (["component", "add", str(specs["component"])], ["cluster", "add", "c1", "--nodes", "3", "--gpus", "1"],
                     ["submit", str(specs["before"]), "--wait"]):
            r = up.cli(*args)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        for program, port, log, block in (("nats-server", up.ports[0], data / "nats.log", "after-nats"),
                                          ("redis-server", up.ports[1], data / "redis.log", "after-redis")):
            pid = _server_pid(up, program)
            assert pid, up.descendants()
            os.kill(pid, signal.SIGKILL)
            said = f"{program} (pid {pid}, port {port}) exited with signal SIGKILL"
            _wait_for(f"line saying {program} was started again", up, lambda s=said: s in up.output())
            line = next(ln for ln in up.output().splitlines() if said in ln)
            assert f"started again on port {port}" in line and str(log) in line, line
            assert said in log.read_text(errors="replace")  # and in the server's own log
            again = _server_pid(up, program)
            assert again and again != pid
            before = up.cli("get", "before", "--json")
            assert before.returncode == 0, before.stdout + before.stderr
            assert json.loads(before.stdout)["status"] == "ready"  # still there (file store / append-only file)
            r = up.cli("submit", str(specs[block]), "--wait")  # the workers reconnected: a new block is placed
            assert r.returncode == 0, r.stdout + r.stderr + up.worker_logs()
            assert json.loads((data / "endpoints.json").read_text())["nats"].endswith(f":{up.ports[0]}")
        children = up.descendants()
    finally:
        code = up.stop(signal.SIGTERM)
    assert code == 0, up.output()
    assert wait_gone(children, up.ports) == ([], [])


def test_a_server_that_keeps_dying_stops_blocks_up_with_an_error_and_nothing_left(tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = Up(data, _env())
    children = up.descendants()
    try:
        deadline = time.time() + 120
        killed: set[int] = set()
        while up.proc.poll() is None and time.time() < deadline:  # kill each nats-server it starts, at once
            pid = _server_pid(up, "nats-server")
            if pid and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                children += up.descendants()
            time.sleep(0.05)
        code = up.stop(signal.SIGTERM)
    finally:
        up.stop(signal.SIGTERM)
    assert code == 2, up.output()
    assert len(killed) == 5, (killed, up.output())
    assert "it died 5 times within 60 s: not started again" in up.output() and "stopping everything" in up.output()
    assert wait_gone(children, up.ports) == ([], [])
    assert not (data / "endpoints.json").exists()
