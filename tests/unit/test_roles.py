"""Roles and worker kinds are named once (issue 35): ``schemas/roles.py`` holds the table, and no
other module of the package spells out a list of kinds (the supervisor's layout and groups, the
worker entry's kinds, the permissions' users, the Redis users, the inventory readers derive from it)."""

from __future__ import annotations

import ast
from pathlib import Path

import aios_blocks
from aios_blocks.schemas import roles
from aios_blocks.schemas.catalog import EVENTS

ROOT = Path(aios_blocks.__file__).resolve().parent


#: complete lists that must stay spelled out, and why
ALLOWED = {"cli/servers.py": "`blocks up` has one option per kind (typer declares each); the test below checks its keys",
           "runtime/auth.py": "each kind's NATS rights, a function per kind; the test below checks it covers the table"}


def _kind_lists(allowed: dict[str, str] = ALLOWED) -> list[str]:
    """``path:line`` of every literal tuple, list, set or dict (keys) naming every worker kind."""
    kinds = set(roles.KINDS)
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "schemas" / "roles.py" or str(path.relative_to(ROOT)) in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
            named = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)} & kinds
            if named == kinds:
                out.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}")
    return out


def test_no_module_but_the_table_lists_the_worker_kinds() -> None:
    assert _kind_lists() == [], "list the kinds in schemas/roles.py (WORKER_KINDS) and derive from it"


def test_blocks_up_has_an_option_for_each_kind() -> None:
    tree = ast.parse((ROOT / "cli" / "servers.py").read_text())
    layouts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "layout" for t in n.targets) and isinstance(n.value, ast.Dict)]
    assert [{k.value for k in d.keys if isinstance(k, ast.Constant)} for d in layouts] == [set(roles.KINDS)]


def test_every_kind_has_its_nats_rights() -> None:
    from aios_blocks.runtime import auth

    assert set(auth._WORKER_RIGHTS) == {*roles.KINDS, "agent"}


def test_the_table_derives_groups_layout_and_users() -> None:
    assert roles.DEFAULT_GROUPS == {"front": ("parser", "gateway", "metrics", "autoscaler", "checker", "rebalancer"),
                                    "serve": ("agent-sim", "executor", "mapper")}
    assert set(roles.DEFAULT_LAYOUT) == set(roles.KINDS) and set(roles.DEFAULT_LAYOUT.values()) == {1}
    assert roles.INVENTORY_KINDS == {"gateway", "controller"}
    # every kind logs in as its own NATS user, and reaches Redis as the workers' user
    assert all(k in roles.NATS_USERS and roles.REDIS_USER[k] == "aios" for k in roles.KINDS)
    # every catalog role has its users (none for the unrestricted admin and the runner)
    assert set(roles.ROLE_USERS) == set(roles.Role)


def test_each_kind_that_publishes_names_a_role_the_catalog_uses() -> None:
    used = {r for e in EVENTS for r in (*e.publishers, *e.responders)}
    for k in roles.WORKER_KINDS:
        assert k.role is None or k.role in used, k
        assert k.summary, k
