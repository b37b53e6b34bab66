"""`blocks up`'s console: a child process (``python -m aios_blocks.console``) that dies with it.

Standard library only (the lean `blocks up` process imports it): the child reads the stream with
the observer role's credentials from the data dir, never the admin URL `blocks up` keeps in its
environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
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


#: a console that exits is started again after this long (doubling, up to ``RESTART_MAX_S``, while
#: it keeps exiting within ``STEADY_S`` of its start): a crash loop does not spin
RESTART_S = 0.5
RESTART_MAX_S = 10.0
STEADY_S = 30.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _last_line(path: Path, since: int) -> str:
    """The last line the console wrote to its log after byte ``since`` (its last run's), cut to
    200 characters; '' when it wrote none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(since, _size(path) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    said = [line.strip() for line in lines if line.strip()]
    return said[-1][:200] if said else ""


class Kept:
    """`blocks up`'s console child, started again on the same host and port when it exits (a
    crash, a kill -9): the URL `blocks up` printed and ``endpoints.json`` names keeps working.
    A watch thread polls it, as ``runtime.supervisor.Supervisor`` does its workers."""

    def __init__(self, data_dir: Path, port: int, host: str = "127.0.0.1", embedded: bool = True,
                 preexec: Callable[[], None] | None = None):
        self._args = (data_dir, port, host, embedded, preexec)
        self._log = Path(data_dir) / "logs" / "console.log"
        self._log_at = _size(self._log)
        self.proc, self.url, self.token = start(*self._args)
        self.restarts = 0
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="console-keeper")
        self._thread.start()

    def _watch(self) -> None:
        delay = RESTART_S
        while not self._stop.wait(0.2):
            if self.proc.poll() is None:
                continue
            if time.monotonic() - self._started >= STEADY_S:
                delay = RESTART_S
            code = self.proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"code {code}"
            # (said, as the supervisor says a worker's restart: it was silent; its own log is logs/console.log)
            # (and why, when it said: a --console-port taken by another program was 'exited with code 1'
            # at each restart, for ever, with the reason in logs/console.log only)
            said = _last_line(self._log, self._log_at)
            why = f" ({said}; its log: {self._log})" if said else ""
            print(f"console exited with {how}{why}; started again on {self.url} in {delay:g} s (restart {self.restarts + 1})",
                  file=sys.stderr, flush=True)
            if self._stop.wait(delay):
                return
            delay = min(RESTART_MAX_S, delay * 2)
            self.restarts += 1
            self._started = time.monotonic()
            self._log_at = _size(self._log)
            self.proc = start(*self._args)[0]

    def stop(self) -> None:
        # (the child first: one started by the watch thread gets PDEATHSIG when that thread ends)
        self._stop.set()
        stop(self.proc)
        self._thread.join(timeout=2)
        stop(self.proc)  # (one started just as it was told to stop)
