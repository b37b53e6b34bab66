"""``blocks examples``: the example files shipped in the package, listed or copied out."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from .common import EXAMPLES, console, err
from .render import _plain, _table

#: what the JSON examples are (they cannot carry a comment)
_EXAMPLE_NOTES = {
    "allocation_input.json": "what a resourceAllocator got for `allocation` (blocks policy run --input)",
    "dry_run_input.json": "what a resourceAllocator got for `dry_run` (blocks policy run --input)",
    "lxd_args.json": "LXD's scriptlet arguments (blocks policy run --kind lxd --input)",
    "selection_input.json": "what a clusterAllocator got for `selection` (blocks policy run --kind clusterAllocator --input)",
    "post_dry_run_input.json": "what a clusterAllocator got for `post_dry_run` (blocks policy run --kind clusterAllocator --input)",
}


def _example_files() -> list[Path]:
    """The example files shipped in the package (``aios_blocks/examples``; the repository's
    ``examples/`` is a link to it): specs, components, policies and recorded inputs."""
    return sorted(p for p in EXAMPLES.iterdir() if p.is_file() and p.suffix in (".yaml", ".json", ".star", ".py")
                  and not p.name.startswith("__"))


def _example_note(path: Path) -> str:
    """The first sentence of the example's leading comment, however many lines it takes (its first
    line alone ended mid-sentence: "..., the Starlark twin of builtin:binpack:"), a long one cut at
    its first colon; or its entry in ``_EXAMPLE_NOTES``."""
    if path.name in _EXAMPLE_NOTES:
        return _EXAMPLE_NOTES[path.name]
    words: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
    text = " ".join(words)
    end = next((i + 1 for i, ch in enumerate(text) if ch == "." and (i + 1 == len(text) or text[i + 1] == " ")), len(text))
    sentence = text[:end]
    if len(sentence) > 200 and ": " in sentence:
        sentence = sentence[:sentence.index(": ")]
    return sentence


def examples_(
    copy: Path = typer.Option(None, "--copy", metavar="DIR", help="Write the examples into DIR (made if missing)."),
    force: bool = typer.Option(False, "--force", help="With --copy: overwrite files that exist in DIR."),
) -> None:
    """List the example files shipped with the package (specs, components, policies, recorded
    policy inputs), or write them into a directory: the README and the `--help` examples name
    them as `examples/FILE`, which `blocks examples --copy examples` makes from an installed wheel.

    Example: `blocks examples`, `blocks examples --copy examples && blocks component add examples/component.yaml`
    """
    files = _example_files()
    if copy is None:
        t = _table("file", "what it is")
        for f in files:
            t.add_row(*_plain(f.name, _example_note(f)))
        console.print(t)
        console.print(escape(f"in {EXAMPLES}; `blocks examples --copy DIR` writes them into DIR"))
        return
    if copy.exists() and not copy.is_dir():
        raise typer.BadParameter(f"{copy} exists and is not a directory", param_hint="--copy")
    there = [f.name for f in files if (copy / f.name).exists()]
    if there and not force:
        err.print(f"[red]not copied[/]: {escape(', '.join(there))} already in {escape(str(copy))} (--force overwrites)")
        raise typer.Exit(1)
    copy.mkdir(parents=True, exist_ok=True)
    for f in files:
        (copy / f.name).write_bytes(f.read_bytes())
    console.print(escape(f"wrote {len(files)} examples into {copy}/: e.g. blocks component add {copy / 'component.yaml'}"))
