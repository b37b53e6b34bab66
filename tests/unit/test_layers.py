"""The package's layers, held by a walk over its imports (issue 35): every ``import`` and
``from ... import`` in every module, those inside functions and ``TYPE_CHECKING`` blocks included,
resolved to the module it names, checked against the rules below. A broken rule is reported as the
rule, the file and line, and what it imported.

The rules: the pure decisions (``handlers/``, ``policies/``) take no I/O layer; the state layer
knows no handler; the contract (``schemas/``) stands alone; the separately deployed node agent
(``agent/``) carries neither the controller's handlers nor the Redis state, nor any worker.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import aios_blocks

PKG = "aios_blocks"
ROOT = Path(aios_blocks.__file__).resolve().parent


@dataclass(frozen=True)
class Rule:
    name: str
    #: modules under this prefix ...
    source: str
    #: ... import nothing under these prefixes
    forbidden: tuple[str, ...]
    #: ... or, when set, nothing of the package outside these prefixes
    only: tuple[str, ...] = ()

    def breaks(self, importer: str, imported: str) -> bool:
        root = self.source.split(".")[0]
        if not _under(importer, self.source) or not _under(imported, root) or imported == root:
            return False  # (the package itself: ``from .. import x`` names x, checked on its own)
        if self.only:
            return not any(_under(imported, p) for p in self.only)
        return any(_under(imported, p) for p in self.forbidden)


_IO = (f"{PKG}.bus", f"{PKG}.state", f"{PKG}.workers", f"{PKG}.executor", f"{PKG}.agent")
RULES = (
    Rule("handlers/ import no I/O layer (bus, state, workers, executor, agent)", f"{PKG}.handlers", _IO),
    Rule("policies/ import no I/O layer (bus, state, workers, executor, agent)", f"{PKG}.policies", _IO),
    Rule("policies/ import no handler (pure policy helpers live with the policy contract)", f"{PKG}.policies",
         (f"{PKG}.handlers",)),
    Rule("state/ imports no handler", f"{PKG}.state", (f"{PKG}.handlers",)),
    Rule("schemas/ imports nothing of the package but itself", f"{PKG}.schemas", (), only=(f"{PKG}.schemas",)),
    Rule("the node agent (agent/) imports neither handlers nor state", f"{PKG}.agent",
         (f"{PKG}.handlers", f"{PKG}.state")),
    Rule("the node agent (agent/) imports no worker, executor or recovery (it is deployed on its own; "
         "what it needs of a worker process is passed in)", f"{PKG}.agent",
         (f"{PKG}.workers", f"{PKG}.executor", f"{PKG}.recovery")),
    *(Rule(f"{layer}/ imports nothing of runtime/ (the processes around the workers: entry, supervisor, servers)",
           f"{PKG}.{layer}", (f"{PKG}.runtime",)) for layer in ("handlers", "policies", "schemas", "state", "bus")),
)

#: known violations a rule still allows, as (rule name, "path:line", imported module): printed by
#: the test, and each must still occur (a fixed one is taken off this list). Empty: every rule holds.
ALLOWED: frozenset[tuple[str, str, str]] = frozenset()


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_of(path: Path, root: Path, pkg: str) -> tuple[str, str]:
    """(the module's dotted name, the package its relative imports start from)."""
    parts = [pkg, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def imports(root: Path = ROOT, pkg: str = PKG) -> list[tuple[str, str, int, str]]:
    """Every import of the package's modules: (importer, "path:line", line, imported module). A
    ``from X import name`` counts as importing ``X`` and ``X.name`` (``name`` may be a module)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module, package = _module_of(path, root, pkg)
        where = f"{pkg}/{path.relative_to(root)}"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names if a.name != "*"]
            for name in names:
                out.append((module, f"{where}:{node.lineno}", node.lineno, name))
    return out


def violations(rules: tuple[Rule, ...] = RULES, found: list[tuple[str, str, int, str]] | None = None) -> list[tuple[str, str, str]]:
    """(rule name, "path:line", imported module) for every import a rule forbids (one per line and rule)."""
    seen: dict[tuple[str, str], tuple[str, str, str]] = {}
    for importer, where, _, imported in imports() if found is None else found:
        for rule in rules:
            if rule.breaks(importer, imported) and (rule.name, where) not in seen:
                seen[(rule.name, where)] = (rule.name, where, imported)
    return sorted(seen.values())


def test_the_layering_rules_hold() -> None:
    broken = violations()
    for allowed in sorted(ALLOWED):
        print("allowed (known, to fix):", " | ".join(allowed))
    new = [v for v in broken if v not in ALLOWED]
    assert not new, "layering rules broken:\n" + "\n".join(f"  {rule}: {where} imports {what}" for rule, where, what in new)
    stale = sorted(ALLOWED - set(broken))
    assert not stale, f"allowances no longer needed (take them off ALLOWED): {stale}"


def test_the_walk_sees_relative_late_and_type_checking_imports(tmp_path: Path) -> None:
    """The walker itself: a function's import, a TYPE_CHECKING one and relative ones of each depth
    are found and resolved, and each rule names the line that broke it."""
    pkg = tmp_path / "pkg"
    for d in ("handlers", "schemas", "state", "workers", "agent"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "handlers" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..state import store\n"
        "def f():\n    from ..agent import x\n    return x\n")
    (pkg / "schemas" / "b.py").write_text("from . import c\nfrom .. import settings\n")
    (pkg / "agent" / "n.py").write_text("import pkg.handlers.faults\nfrom ..schemas import b\nfrom ..workers import base\n")
    (pkg / "state" / "s.py").write_text("from ..schemas.b import x\n")
    rules = tuple(Rule(r.name, r.source.replace(PKG, "pkg"), tuple(p.replace(PKG, "pkg") for p in r.forbidden),
                       tuple(p.replace(PKG, "pkg") for p in r.only)) for r in RULES)
    found = imports(pkg, "pkg")
    assert {(where, what) for _, where, what in violations(rules, found)} == {
        ("pkg/handlers/a.py:3", "pkg.state"),
        ("pkg/handlers/a.py:5", "pkg.agent"),
        ("pkg/schemas/b.py:2", "pkg.settings"),
        ("pkg/agent/n.py:1", "pkg.handlers.faults"),
        ("pkg/agent/n.py:3", "pkg.workers"),
    }
    assert {rule for rule, _, _ in violations(rules, found)} == {RULES[0].name, RULES[4].name, RULES[5].name, RULES[6].name}


def test_the_spec_size_default_is_the_settings_default() -> None:
    """schemas/ir.py no longer reads the setting at import: its default must be the setting's."""
    from aios_blocks.schemas.ir import DEFAULT_MAX_SPEC_BYTES
    from aios_blocks.settings import Settings

    assert Settings.model_fields["max_spec_bytes"].default == DEFAULT_MAX_SPEC_BYTES
