"""`blocks up`'s console: a child process (``python -m aios_blocks.console``) that dies with it.

Standard library only (the lean `blocks up` process imports it): the child reads the stream with
the observer role's credentials from the data dir, never the admin URL `blocks up` keeps in its
environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .token import ensure_token

#: the environment the console must not inherit from `blocks up` (the admin's URLs)
_DROP = ("AIOS_NATS_URL", "AIOS_REDIS_URL")


def start(data_dir: Path, port: int, host: str = "127.0.0.1", embedded: bool = True,
          preexec: Callable[[], None] | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start the console on ``host:port``: (process, its URL, the admin token). ``embedded``: the
    servers are `blocks up`'s own, so the child logs in as the observer from the data dir.
    ``preexec``: the supervisor's ``die_with_parent`` (a SIGKILLed `blocks up` takes it along)."""
    token = ensure_token(data_dir)
    env = {k: v for k, v in os.environ.items() if not (embedded and k in _DROP)}
    logs = Path(data_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "console.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aios_blocks.console", "--data-dir", str(data_dir), "--host", host, "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=preexec,
        )
    return proc, f"http://{host}:{port}/", token


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
