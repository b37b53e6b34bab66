"""A worker process loads what its kind uses and no more (``runtime/main.py``; the idle footprint
of ``blocks up``, docs/benchmarks.md): no other kind's module, no CLI (typer, rich), no Starlark
unless a policy is Starlark, no aiohttp in kinds that serve no HTTP. Each check is a fresh
interpreter importing what the worker's entry imports before it connects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

#: kind -> the modules its entry (``_run_kind``) imports, and the top-level packages it must not load
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "parser": (("parser",), ("aiohttp",)),
    "gateway": (("gateway",), ("aiohttp",)),
    "controller": (("controller", "vcluster", "health"), ("aiohttp",)),
    "autoscaler": (("autoscaler",), ("aiohttp",)),
    "agent-sim": (("agent.fleet",), ()),
    "executor": (("executor",), ()),
    "metrics": (("collector",), ()),
    "checker": (("checker",), ()),
    "rebalancer": (("rebalancer",), ("aiohttp",)),
}
NEVER = ("rich", "typer", "starlark", "yaml")
WORKER_MODULES = ("parser", "gateway", "controller", "vcluster", "health", "autoscaler", "agent.fleet", "executor", "collector", "checker", "rebalancer")


def _module(m: str) -> str:
    """A kind's module: under ``aios_blocks.workers``, or (dotted) under ``aios_blocks``."""
    return f"aios_blocks.{m}" if "." in m else f"aios_blocks.workers.{m}"


def _loaded(modules: tuple[str, ...]) -> set[str]:
    code = (
        "import json, sys\n"
        "from aios_blocks.runtime import main\n"
        "main.lean_imports()\n"
        "import aios_blocks.workers.base, aios_blocks.workers.telemetry\n"
        + "".join(f"import {_module(m)}\n" for m in modules)
        # (a stand-in for a module not loaded yet, aios_blocks.OnFirstUse: aiohttp's, is not loaded)
        + "print(json.dumps(sorted(n for n, m in sys.modules.items() if type(m).__name__ != 'OnFirstUse')))\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_worker_imports_only_what_its_kind_uses(kind: str) -> None:
    modules, absent = KINDS[kind]
    loaded = _loaded(modules)
    tops = {m.split(".")[0] for m in loaded}
    assert not tops & set(NEVER + absent), f"{kind} loads {sorted(tops & set(NEVER + absent))}"
    others = {_module(m) for m in WORKER_MODULES if m not in modules} & loaded
    assert not others, f"{kind} loads other kinds' modules: {sorted(others)}"


def test_the_entry_itself_imports_only_the_standard_library() -> None:
    code = ("import sys; before = set(sys.modules); import aios_blocks.runtime.main; "
            "print(sorted(n for n in set(sys.modules) - before if type(sys.modules[n]).__name__ != 'OnFirstUse'))")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    new = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    assert not {m.split(".")[0] for m in eval(new)} - {"aios_blocks", *sys.stdlib_module_names}


def test_lean_imports_leave_the_blocked_extras_importable() -> None:
    code = (
        "from aios_blocks.runtime import main\n"
        "main.lean_imports()\n"
        "import nats.aio.transport as t, structlog.dev as d\n"
        "assert type(t.aiohttp).__name__ == 'OnFirstUse' and d.rich is None\n"  # aiohttp: not loaded until used
        "import aiohttp, rich\n"  # a kind that uses aiohttp itself still gets it
        "assert aiohttp.ClientSession.__module__ == 'aiohttp.client' and rich.print\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
