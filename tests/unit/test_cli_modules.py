"""The CLI by noun (issue 35): every command's function lives in the module of its noun, which
stays under 500 lines; ``cli/main.py`` is only the old name of the entry point."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from typer.main import get_command

import aios_blocks.cli
from aios_blocks.cli import app as app_module
from aios_blocks.cli import main

CLI = Path(aios_blocks.cli.__file__).parent
#: the modules commands live in, and their shared parts
NOUNS = ("blocks", "inventory", "nodes", "vcluster", "policy", "state", "servers", "task", "trace", "priority", "console", "rebalance", "tenants", "examples",
         "sidecar_auth", "dlq", "observers")
SHARED = ("app", "common", "render")


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
    subs = getattr(cmd, "commands", None)
    if not subs:
        return {" ".join(path): cmd}
    out: dict[str, Any] = {}
    for name, sub in subs.items():
        out.update(_commands(sub, (*path, name)))
    return out


def test_every_command_lives_in_a_noun_module() -> None:
    where = {name: cmd.callback.__module__ for name, cmd in _commands(get_command(app_module.app)).items()}
    assert len(where) > 40
    strays = {name: mod for name, mod in where.items() if mod.rsplit(".", 1)[-1] not in NOUNS}
    assert not strays, f"commands outside the noun modules: {strays}"
    assert where["submit"] == "aios_blocks.cli.blocks" and where["policy run"] == "aios_blocks.cli.policy"
    assert where["state digest"] == "aios_blocks.cli.state" and where["up"] == "aios_blocks.cli.servers"


def test_no_cli_module_is_over_500_lines() -> None:
    sizes = {m: len((CLI / f"{m}.py").read_text().splitlines()) for m in (*NOUNS, *SHARED)}
    assert not {m: n for m, n in sizes.items() if n > 500}, sizes


def test_the_old_entry_point_is_the_app() -> None:
    assert main.app is app_module.app and main.run is app_module.run
    for m in (*NOUNS, *SHARED):
        importlib.import_module(f"aios_blocks.cli.{m}")
