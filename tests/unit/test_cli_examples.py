"""`blocks examples` (issue 32, item 13): a wheel has no repository `examples/`, while the README
and the `--help` examples name `examples/FILE`; the command lists the examples the package ships
and writes them where the user wants them."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from typer.testing import CliRunner

from aios_blocks.cli.main import app

SHIPPED = files("aios_blocks.examples")


def test_examples_lists_what_the_package_ships_with_what_each_is() -> None:
    r = CliRunner().invoke(app, ["examples"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for name in ("component.yaml", "block.yaml", "first_fit.py", "binpack.star", "allocation_input.json", "lxd_args.json"):
        assert name in r.output
    assert "An example component: a 1-GPU inference server" in r.output  # the file's own first comment
    assert "__init__.py" not in r.output


def test_examples_copy_writes_them_and_keeps_what_is_there_unless_forced(tmp_path: Path) -> None:
    dest = tmp_path / "examples"
    r = CliRunner().invoke(app, ["examples", "--copy", str(dest)])
    assert r.exit_code == 0, r.output
    for name in ("component.yaml", "block.yaml", "first_fit.py", "dry_run_input.json", "lxd_most_free_memory.star"):
        assert (dest / name).read_bytes() == SHIPPED.joinpath(name).read_bytes()
    assert not (dest / "__init__.py").exists()

    (dest / "block.yaml").write_text("mine\n")
    r = CliRunner().invoke(app, ["examples", "--copy", str(dest)])
    assert r.exit_code == 1 and "already in" in r.output and "--force" in r.output
    assert (dest / "block.yaml").read_text() == "mine\n"
    r = CliRunner().invoke(app, ["examples", "--copy", str(dest), "--force"])
    assert r.exit_code == 0, r.output
    assert (dest / "block.yaml").read_bytes() == SHIPPED.joinpath("block.yaml").read_bytes()


def test_the_help_that_names_examples_says_how_to_get_them() -> None:
    for cmd in (["component", "add", "--help"], ["submit", "--help"]):
        r = CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})
        assert "examples/" in r.output and "blocks examples --copy" in " ".join(r.output.split()), cmd
