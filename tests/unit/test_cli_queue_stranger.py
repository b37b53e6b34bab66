"""A stranger's pass over the queue, priority, rebalance and trace commands (no servers): bad
arguments are refused in one clear line, exit 2, before anything is looked for."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.main import app


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    import os

    for key in [k for k in os.environ if k.startswith("AIOS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AIOS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLUMNS", "200")
    return CliRunner()


def test_rebalance_refuses_a_negative_max_moves(cli: CliRunner) -> None:
    """-1 was the option's hidden 'not given': --max-moves -5 ran with AIOS_REBALANCE_MAX_MOVES (8)."""
    r = cli.invoke(app, ["rebalance", "--dry-run", "--max-moves", "-5"])
    assert r.exit_code == 2, r.output
    assert "--max-moves" in r.output and "greater than or equal to 0" in r.output, r.output
