"""What `blocks demo` and a killed `blocks up` leave behind (issue 32, items 14 and 16): the demo's
block can be looked at again with the commands it prints, from its own data dir; a SIGKILLed
`blocks up` leaves no traceback in its workers' logs."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import psutil

from .test_cli import BLOCKS, ROOT

ENV = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}


def _blocks(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert argv[0] == "blocks", argv
    return subprocess.run([*BLOCKS, *argv[1:]], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def _up(data_dir: str, cwd: Path) -> subprocess.Popen[str]:
    """`blocks up --data-dir DATA_DIR`, returned once it says where its logs are (it is up)."""
    proc = subprocess.Popen([*BLOCKS, "up", "--data-dir", data_dir], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # bounded by the servers' own start-up time; EOF if it exits
        seen.append(line)
        if line.startswith("logs:"):
            return proc
    raise AssertionError(f"blocks up did not start: {''.join(seen)}")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_the_demo_leaves_its_block_in_its_own_data_dir_with_the_commands_to_see_it(tmp_path: Path) -> None:
    r = _blocks(["blocks", "demo", "--timeout", "120"], tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / ".aios-demo" / "jetstream").is_dir()
    assert not (tmp_path / ".aios-data").exists()  # not nested in (nor mixed with) a `blocks up`'s data dir
    lines = [line.strip() for line in r.stdout.splitlines()]
    up = next(line for line in lines if line.startswith("blocks up --data-dir"))
    replay = next(line for line in lines if line.startswith("blocks replay "))
    bid = replay.split()[2]
    assert re.fullmatch(r"blk-[0-9a-f]+", bid), replay

    # the printed commands, as printed (no servers run now: the demo stopped them)
    up_argv = shlex.split(up.removesuffix("&"))
    proc = _up(up_argv[up_argv.index("--data-dir") + 1], tmp_path)
    try:
        out = _blocks(shlex.split(replay.split("(or:")[0]), tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert re.search(r"\bcreate\b", out.stdout) and re.search(r"\bready\b", out.stdout), out.stdout
        got = _blocks(["blocks", "get", bid, "--data-dir", ".aios-demo"], tmp_path)
        assert got.returncode == 0 and f"block {bid}: ready" in got.stdout, got.stdout + got.stderr
    finally:
        _stop(proc)


def test_a_sigkilled_blocks_up_leaves_no_traceback_in_the_worker_logs(tmp_path: Path) -> None:
    proc = _up(str(tmp_path / "data"), ROOT)
    try:
        d = str(tmp_path / "data")
        for argv in (["blocks", "component", "add", "examples/component.yaml", "--data-dir", d],
                     ["blocks", "cluster", "add", "c1", "--nodes", "2", "--data-dir", d],
                     ["blocks", "submit", "examples/block.yaml", "--wait", "--data-dir", d]):
            r = _blocks(argv, ROOT)
            assert r.returncode == 0, (argv, r.stdout, r.stderr)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.kill()  # SIGKILL: its servers and workers die with it (their parent-death signal)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = sorted((tmp_path / "data" / "logs").glob("*.log"))
    assert logs
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text and "the handler is closed" not in text, f"{log.name}:\n{text[-3000:]}"
