"""Fixtures shared by the unit tests' files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner of the ``blocks`` commands with no servers to find: no AIOS_* in the environment,
    an empty data dir, a wide terminal."""
    for key in [k for k in os.environ if k.startswith("AIOS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AIOS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLUMNS", "200")
    return CliRunner()
