"""`blocks pending` and `blocks queue` (where people look for the waiting blocks) said only "No such
command": the line now names `blocks list --pending` (and `blocks explain BID`), still one line and
exit 2; `blocks --help` names `--pending` beside `list`. The real entry point, no servers needed."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("word", ["pending", "queue"])
def test_the_pending_queue_is_pointed_to_from_where_people_look(word: str) -> None:
    r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", word], capture_output=True, text=True, timeout=60)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"No such command '{word}'" in lines[0] and "blocks list --pending" in lines[0] and "blocks explain BID" in lines[0], lines


def test_the_top_help_names_list_pending() -> None:
    r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", "--help"], capture_output=True, text=True, timeout=60,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.strip("│ ").startswith("list "))
    assert "--pending" in row, row
