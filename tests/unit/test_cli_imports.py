"""The `blocks` entry point starts light (issue 32, item 12): importing it, `blocks --help` and
`blocks list` load neither the NATS client, nor the models, policies, store or settings; each
command imports what it needs. Checked on ``sys.modules`` of a fresh interpreter, not on time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

#: what no command that does not need it may pay for at start-up
HEAVY = (
    "nats", "aiohttp", "redis", "pydantic", "pydantic_settings", "msgspec", "structlog", "yaml", "starlark",
    "asyncio", "typer.rich_utils", "markdown_it", "aios_blocks.bus", "aios_blocks.schemas", "aios_blocks.state",
    "aios_blocks.policies", "aios_blocks.handlers", "aios_blocks.settings", "aios_blocks.runtime.auth",
    "aios_blocks.runtime.embedded", "aios_blocks.cli.client",
)
#: light exceptions under a heavy prefix: the one table of roles and worker kinds (standard library
#: only; the CLI's help and the servers' lookup name the kinds from it) and its empty package
LIGHT = ("aios_blocks.schemas", "aios_blocks.schemas.roles")


def _modules(code: str, env: dict[str, str] | None = None) -> list[str]:
    """Every module in sys.modules after ``code`` ran in a new process (SystemExit caught)."""
    body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
    # (a module still standing in for one not loaded, ``aios_blocks.OnFirstUse``, is not loaded)
    probe = (f"import json, sys\ntry:\n{body}\nexcept SystemExit:\n    pass\n"
             "print(json.dumps(sorted(n for n, m in sys.modules.items() if type(m).__name__ != 'OnFirstUse')),"
             " file=sys.__stderr__)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})}, cwd="/")
    return list(json.loads(out.stderr.strip().splitlines()[-1]))


def _loaded(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The HEAVY modules (or their submodules) in sys.modules after ``code`` ran in a new process."""
    return [m for m in _modules(code, env) if m not in LIGHT and any(m == h or m.startswith(h + ".") for h in HEAVY)]


def _unreachable() -> dict[str, str]:
    """NATS and Redis URLs of a port nothing listens on: a command fails to connect, after its imports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"AIOS_NATS_URL": f"nats://127.0.0.1:{port}", "AIOS_REDIS_URL": f"redis://127.0.0.1:{port}/0"}


def test_importing_the_entry_point_loads_only_typer_and_rich() -> None:
    assert _loaded("import aios_blocks.cli.main") == []
    # the app and every command module it registers (cli/app.py imports them all)
    assert _loaded("import aios_blocks.cli.app") == []


def test_help_loads_nothing_heavy_not_even_typers_help_module() -> None:
    assert _loaded("""
        sys.argv = ["blocks", "--help"]
        from aios_blocks.cli.main import run
        run()
    """) == []


def test_list_loads_only_its_own_redis_reader() -> None:
    env = _unreachable()
    loaded = _loaded("""
        sys.argv = ["blocks", "list"]
        from aios_blocks.cli.main import run
        run()
    """, env)
    assert "aios_blocks.state.views" in loaded  # it did try Redis, through state.views' reader (hiredis)
    # (pydantic: typer converts option values through it when a command runs)
    assert [m for m in loaded if not m.startswith("pydantic")
            and m not in ("aios_blocks.state", "aios_blocks.state.keys", "aios_blocks.state.views")] == []


#: what the workers run and the CLI's client needs only for some commands (``plan``, ``decisions``,
#: ``scale``, ...): ``cli/client.py`` imports them in those methods, not at its top
WORKER_STEPS = (
    "aios_blocks.handlers", "aios_blocks.policies", "aios_blocks.recovery", "aios_blocks.projections",
    "aios_blocks.state.inventory", "aios_blocks.state.priority",
    "multiprocessing", "statistics",
)


def _steps(mods: list[str]) -> list[str]:
    return [m for m in mods if any(m == w or m.startswith(w + ".") for w in WORKER_STEPS)]


def test_the_client_loads_no_handlers_policies_or_recovery() -> None:
    # (instance_id: how `blocks scale` / `reassign` name the instance they ask for)
    mods = _modules("import aios_blocks.cli.client as c; assert c.instance_id('b', 0) == 'b-0'")
    assert "aios_blocks.cli.client" in mods and "aios_blocks.bus.nats_bus" in mods
    assert _steps(mods) == []
    # the CLI's own import (the entry point) loads none of them either
    assert _steps(_modules("import aios_blocks.cli.main")) == []


def test_dlq_connects_without_loading_handlers_policies_or_recovery() -> None:
    env = _unreachable()
    mods = _modules("""
        sys.argv = ["blocks", "dlq"]
        from aios_blocks.cli.main import run
        run()
    """, env)
    assert "aios_blocks.cli.client" in mods  # it did open a Client (and failed to reach NATS)
    assert _steps(mods) == []


def test_a_command_that_connects_to_nats_does_not_load_aiohttp() -> None:
    # nats-py imports aiohttp for its websocket transport, which a nats:// URL never uses: it
    # stands unloaded (aios_blocks.OnFirstUse) until something uses it (it was ~0.3 s a command)
    env = _unreachable()
    mods = _modules("""
        sys.argv = ["blocks", "dlq"]
        from aios_blocks.cli.main import run
        run()
    """, env)
    assert "nats.aio.transport" in mods  # nats-py was imported, its websocket transport with it
    assert [m for m in mods if m == "aiohttp" or m.startswith("aiohttp.")] == []


def test_aiohttp_loads_whole_at_its_first_use_whichever_way_it_is_used() -> None:
    # the transport's own reference, a plain import, and a submodule imported first
    for first_use in ("import nats.aio.transport as t; t.aiohttp.WSMsgType.BINARY",
                      "import aiohttp; aiohttp.ClientSession",
                      "from aiohttp import web; web.Application"):
        mods = _modules(f"import aios_blocks, nats.aio.transport\n{first_use}\n"
                        "import aiohttp; from aiohttp import web\n"
                        "assert aiohttp.ClientSession.__module__ == 'aiohttp.client', aiohttp.ClientSession\n"
                        "assert web.Application.__name__ == 'Application'\n"
                        "assert type(sys.modules['aiohttp']).__name__ == 'module'")
        assert "aiohttp" in mods and "aiohttp.client" in mods and "aiohttp.web" in mods, first_use
