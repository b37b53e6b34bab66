"""`blocks --version`: a stranger's first command said `No such option: --version`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def test_blocks_version_prints_the_installed_version_and_exits_0() -> None:
    r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"aios-blocks {version('aios-blocks')}\n"
