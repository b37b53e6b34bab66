"""`blocks demo` looks after its embedded servers as `blocks up` does (``runtime.server_keeper``):
its nats-server killed while the demo waits for its block is started again on the same port,
config and data dir (said on stderr), and the demo goes on to its ready block (exit 0). Before,
nothing watched them: the demo waited out its --timeout while its client retried a dead server.
The real `blocks demo` process; the real server killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import psutil

from .test_cli import BLOCKS

ENV = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}


def test_the_demo_starts_a_killed_nats_server_again_and_goes_on(tmp_path: Path) -> None:
    proc = subprocess.Popen([*BLOCKS, "demo", "--timeout", "90", "--data-dir", str(tmp_path / "demo")], cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)  # type: ignore[union-attr, arg-type]
    reader.start()
    out: list[str] = []
    try:
        for line in proc.stdout:  # bounded: the demo gives up after its --timeout
            out.append(line)
            if line.startswith("submitted block"):
                break
        [nats] = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "nats-server"]
        nats.send_signal(signal.SIGKILL)
        out += proc.stdout.readlines()
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    said = "".join(out) + "".join(errors)
    assert code == 0 and "ready" in "".join(out), said
    assert f"nats-server (pid {nats.pid}" in said and "exited with signal SIGKILL" in said and "started again" in said, said
