"""The CLI's help, as the README promises it: every command's ``--help`` has an example."""

from __future__ import annotations

from typing import Any

from typer.main import get_command

from aios_blocks.cli.main import app


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> dict[str, Any]:
    subs = getattr(cmd, "commands", None)
    if not subs:
        return {" ".join(path): cmd}
    out: dict[str, Any] = {}
    for name, sub in subs.items():
        out.update(_commands(sub, (*path, name)))
    return out


def test_every_command_has_an_example_in_its_help() -> None:
    commands = _commands(get_command(app))
    assert {"submit", "vcluster list", "vcluster get", "node drain", "policy run"} <= set(commands)
    missing = sorted(name for name, cmd in commands.items() if "Example" not in (cmd.help or ""))
    assert not missing, f"no example in the --help of: {', '.join(missing)}"
