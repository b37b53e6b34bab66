"""A command run through typer's CliRunner (as the CLI tests do) leaves the library logs writing
to whatever stderr is current, not to the runner's stream it closed: a later warning anywhere in
the same process must not fail with 'I/O operation on closed file'."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from typer.testing import CliRunner

from aios_blocks.cli.main import app

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "aios_blocks" / "examples"


def test_library_logs_outlive_a_cli_runner_command(capsys: pytest.CaptureFixture[str]) -> None:
    r = CliRunner().invoke(app, ["policy", "run", "builtin:binpack", "--input", str(EXAMPLES / "allocation_input.json")])
    assert r.exit_code == 0, r.output
    structlog.get_logger("aios.test").warning("after.the.command", n=1)  # the runner's stderr is closed by now
    assert "after.the.command" in capsys.readouterr().err
