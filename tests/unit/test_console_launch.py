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
