"""`blocks up`'s console child (``console.launch.Kept``): one that exits is started again, and says so
(its process here is a stand-in that sleeps: what is watched is the same ``Popen``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.console import launch


def test_a_console_that_dies_is_started_again_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # a kill -9 of the console was answered without a word on blocks up's terminal
    def start(*args: Any, **kwargs: Any) -> tuple[subprocess.Popen[bytes], str, str]:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        return proc, "http://127.0.0.1:1234/", "tok"

    monkeypatch.setattr(launch, "start", start)
    kept = launch.Kept(tmp_path, 1234)
    try:
        first = kept.proc
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kept.proc is first:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.05)
        assert kept.restarts == 1
    finally:
        kept.stop()
    err = capsys.readouterr().err
    assert "console exited with signal SIGKILL; started again on http://127.0.0.1:1234/ in 0.5 s (restart 1)" in err, err


def test_a_console_that_exits_says_its_last_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # a --console-port taken by another program: 'console exited with code 1' at every restart, for
    # ever, the reason in logs/console.log only (the real one: test_console's taken-port test)
    log = tmp_path / "logs" / "console.log"
    log.parent.mkdir()
    log.write_text("an earlier run's last line\n")

    def start(*args: Any, **kwargs: Any) -> tuple[subprocess.Popen[bytes], str, str]:
        with open(log, "ab") as out:  # (as launch.start: the child's output goes to its log)
            proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.3); "
                                     "print('Traceback ...'); print('OSError: [Errno 98] address already in use'); sys.exit(1)"],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return proc, "http://127.0.0.1:1234/", "tok"

    monkeypatch.setattr(launch, "start", start)
    kept = launch.Kept(tmp_path, 1234)
    try:
        deadline = time.monotonic() + 10
        while kept.restarts < 1:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.05)
    finally:
        kept.stop()
    err = capsys.readouterr().err
    assert (f"console exited with code 1 (OSError: [Errno 98] address already in use; its log: {log}); started again on "
            "http://127.0.0.1:1234/ in 0.5 s (restart 1)") in err, err
