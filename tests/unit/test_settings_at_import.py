"""No setting is read at import (issue 35): one ``Settings`` is built per process and passed in, or
read when asked. An AST walk of every module of the package over what runs when it is imported
(module and class bodies, decorators, default arguments) finds no ``os.environ`` / ``os.getenv``
and no call of the settings module (``load``, ``current``, ``Settings``), whatever it is imported as."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import aios_blocks

ROOT = Path(aios_blocks.__file__).resolve().parent


def _import_time(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes evaluated when the module is imported (function bodies are not)."""

    def body(stmts: list[ast.stmt]) -> Iterator[ast.AST]:
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from s.decorator_list
                yield from s.args.defaults
                yield from (d for d in s.args.kw_defaults if d is not None)
            elif isinstance(s, ast.ClassDef):
                yield from s.decorator_list
                yield from s.bases
                yield from body(s.body)
            else:
                yield s

    yield from body(tree.body)


def _settings_names(tree: ast.Module) -> set[str]:
    """Local names bound to the settings module or its readers."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[-1] == "settings":
            names |= {a.asname or a.name for a in n.names if a.name in ("load", "current", "Settings")}
        elif isinstance(n, ast.ImportFrom) and any(a.name == "settings" for a in n.names):
            names |= {a.asname or a.name for a in n.names if a.name == "settings"}
    return names


def _walk_eager(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that skips lambdas (run later, not at import)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.Lambda):
            yield from _walk_eager(child)


def reads_at_import(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        local = _settings_names(tree)
        for top in _import_time(tree):
            for n in _walk_eager(top):
                what = ""
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "os" and n.attr in ("environ", "getenv"):
                    what = f"os.{n.attr}"
                elif isinstance(n, ast.Call):
                    f = n.func
                    if isinstance(f, ast.Name) and f.id in local:
                        what = f"{f.id}()"
                    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in local:
                        what = f"{f.value.id}.{f.attr}()"
                if what:
                    out.append(f"{path.relative_to(root)}:{getattr(n, 'lineno', 0)}: {what}")
    return out


def test_no_setting_is_read_at_import() -> None:
    assert reads_at_import() == []


def test_the_walk_sees_each_way_of_reading(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "import os\nfrom .settings import load as load_settings\n"
        "X = load_settings().max_candidates\n"
        "Y = os.environ.get('AIOS_Y', '1')\n"
        "def f(t=os.getenv('AIOS_T')):\n    return os.environ['AIOS_F']  # at call time: fine\n"
        "class C:\n    z = load_settings()\n"
        "g = lambda: load_settings()  # at call time: fine\n"
    )
    assert reads_at_import(tmp_path) == ["a.py:3: load_settings()", "a.py:4: os.environ", "a.py:5: os.getenv",
                                         "a.py:8: load_settings()"]
