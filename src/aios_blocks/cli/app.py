"""The ``blocks`` command: the typer app, its global options, its help and its entry point
(``run``). Each command lives in the module of its noun (``blocks``, ``inventory``, ``vcluster``,
``policy``, ``state``, ``dlq``, ``servers``, ``task``, ``trace``; shared parts in ``common`` and ``render``)
and is registered below, in the order ``blocks --help`` lists them: one jump from a command's name
to its function.

Start-up: this module and those it imports load only typer and rich; every other module (the
NATS and Redis clients, pydantic models, policies, ...) is imported by the command that needs it
(tests/unit/test_cli_imports.py holds it to that).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from . import (
    blocks,
    console,
    dlq,
    examples,
    inventory,
    nodes,
    observers,
    policy,
    priority,
    rebalance,
    servers,
    sidecar_auth,
    state,
    task,
    tenants,
    trace,
    vcluster,
)
from .common import DataDir, _input_errors, _one_line, err

app = typer.Typer(
    help="aios-blocks: place and run AI blocks on GPU clusters over NATS JetStream and Redis.\n\n"
    "Servers: AIOS_NATS_URL / AIOS_REDIS_URL, else the embedded ones a running `blocks up` started.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
component_app = typer.Typer(help="Register components.", no_args_is_help=True)
cluster_app = typer.Typer(help="Register (simulated inventory), list and remove clusters.", no_args_is_help=True)
node_app = typer.Typer(help="Register (simulated inventory), list, drain and remove nodes.", no_args_is_help=True)
policy_app = typer.Typer(help="Run and register policies.", no_args_is_help=True)
state_app = typer.Typer(help="Inspect the Redis state (digest, diff against the stream).", no_args_is_help=True)
app.add_typer(component_app, name="component")
app.add_typer(cluster_app, name="cluster")
app.add_typer(node_app, name="node")
app.add_typer(policy_app, name="policy")
app.add_typer(state_app, name="state")
priority_class_app = typer.Typer(help="Register and list priority classes (docs/priority.md).", no_args_is_help=True)
quota_app = typer.Typer(help="Tenants' GPU quotas that borrow within a cohort (docs/priority.md).", no_args_is_help=True)
app.add_typer(priority_class_app, name="priority-class")
app.add_typer(quota_app, name="quota")

def _version(value: bool) -> None:
    """``blocks --version``: the installed package's version (the first thing a stranger asks)."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        print(f"aios-blocks {version('aios-blocks')}")
    except PackageNotFoundError:
        print("aios-blocks (not installed: run from a source tree)")
    raise typer.Exit(0)


@app.callback()
def _root(
    data_dir: Path = typer.Option(
        None, "--data-dir", metavar="PATH", show_default=False,
        help="Data dir of the embedded servers, for every command (as after the command: else AIOS_DATA_DIR, "
        "else ./.aios-data, searched up from here).",
    ),
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                      help="Print the installed version and exit."),
) -> None:
    # (no docstring: the app's help is Typer(help=...)); the value is read by each command's --data-dir
    pass


def _top_help() -> None:
    """``blocks --help``, drawn as typer draws it (usage, description, options and commands in
    panels) with rich's panel and table only: typer's own help module loads a Markdown parser and
    rich's traceback machinery first, which more than doubles the time the most common command
    takes. Every command's own ``--help`` is typer's."""
    import re

    from rich import box
    from rich.padding import Padding
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    ctx = typer.Context(group, info_name="blocks")

    def rich_text(text: str) -> Text:  # the help's Markdown is `code` spans only
        return Text.from_markup(re.sub(r"`([^`]+)`", r"[bold]\1[/]", escape(" ".join(text.split()))))

    def panel(title: str, rows: list[tuple[str, str, str]]) -> Panel:
        grid = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column(style="bold yellow", no_wrap=True)
        grid.add_column(ratio=1)
        for name, meta, text in rows:
            grid.add_row(name, meta, rich_text(text))
        return Panel(grid, title=title, title_align="left", border_style="dim", box=box.ROUNDED)

    out = Console()
    out.print(Text.assemble("\n ", ("Usage:", "yellow"), f" blocks {' '.join(group.collect_usage_pieces(ctx))}\n"))
    for para in (group.help or "").split("\n\n"):
        out.print(Padding(rich_text(para), (0, 1, 1, 1)))
    options = []
    for param in group.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            names, text = record
            name, _, meta = names.partition(" ")
            options.append((name, meta, text))
    out.print(panel("Options", options))
    commands = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is not None and not cmd.hidden:
            commands.append((name, "", cmd.short_help or (cmd.help or "").split("\n\n")[0]))
    out.print(panel("Commands", commands))


def run() -> None:
    """The `blocks` entry point: the typer app, with every user mistake as one line on stderr and
    exit 2 (usage), 1 (refused: unknown, in use), never a traceback. AIOS_DEBUG=1 shows them."""
    if sys.argv[1:] == ["--help"]:
        _top_help()
        sys.exit(0)
    try:
        rv = app(standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:  # usage errors: bad option values, missing arguments
        _usage_error(exc)
    except SystemExit as exc:  # AIOS_* settings that do not fit (settings.BadSettings, one line each): bad input
        from ..settings import BadSettings

        if not isinstance(exc, BadSettings):
            raise
        print(exc, file=sys.stderr)
        sys.exit(2)
    except TimeoutError as exc:  # a request the server refused is never answered: say which, if so
        if os.environ.get("AIOS_DEBUG"):
            raise
        _timed_out(exc)
    except _input_errors() as exc:
        if os.environ.get("AIOS_DEBUG"):
            raise
        err.print(f"[red]error:[/] {escape(_one_line(exc))}")
        sys.exit(2)
    except LookupError as exc:
        if os.environ.get("AIOS_DEBUG"):
            raise
        err.print(f"[red]{escape(_one_line(exc))}[/]")
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


#: commands people look for under another name: where that is (the unknown command's line says it)
ELSEWHERE = {
    "pending": "the pending queue is `blocks list --pending`; why one block waits: `blocks explain BID`",
    "queue": "the pending queue is `blocks list --pending`; why one block waits: `blocks explain BID`",
}


def _usage_error(exc: typer.TyperException) -> NoReturn:
    """A usage error (a bad option value, a missing argument): one line, the command's help named
    (an unknown command that is elsewhere: where, ``ELSEWHERE``)."""
    ctx = getattr(exc, "ctx", None)
    hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    unknown = re.match(r"No such command '([^']*)'", message)
    if unknown and unknown.group(1) in ELSEWHERE:
        hint = f": {ELSEWHERE[unknown.group(1)]}"
    if message.strip():  # (no arguments at all: the help was printed, nothing to add)
        err.print(f"[red]error:[/] {escape(message)}{hint}")
    sys.exit(int(getattr(exc, "exit_code", 2)))


def _timed_out(exc: TimeoutError) -> NoReturn:
    """A request never answered: the server's refusal it met, if any, and what to set (exit 1), else
    the timeout (exit 2)."""
    from ..bus.nats_bus import inbox_hint, recent_denials

    denied = recent_denials()
    if not denied:
        err.print(f"[red]error:[/] {escape(_one_line(exc) or 'timed out')}")
        sys.exit(2)
    if hint := inbox_hint(denied[-1]):  # the answer could not be read: say what to set
        err.print(f"[red]refused:[/] {escape(denied[-1])}: {escape(hint)}")
        sys.exit(1)
    role = f" (AIOS_ROLE={os.environ['AIOS_ROLE']})" if os.environ.get("AIOS_ROLE") else ""
    err.print(f"[red]refused:[/] {escape(denied[-1])}: this command's NATS user{escape(role)} may not do that "
              "(docs/security.md lists each role's rights)")
    sys.exit(1)


# -- the commands, in the order `blocks --help` lists them ----------------------------------------
app.command()(servers.up)
app.command()(servers.down)
app.command()(task.task)
app.command()(servers.worker)
app.command()(servers.agent)
app.command("instance-key")(servers.instance_key)
app.command()(servers.demo)
app.command("examples")(examples.examples_)
component_app.command("add")(inventory.component_add)
component_app.command("list")(inventory.component_list)
cluster_app.command("list")(inventory.cluster_list)
node_app.command("list")(inventory.node_list)
cluster_app.command("add")(inventory.cluster_add)
node_app.command("add")(inventory.node_add)
node_app.command("get")(inventory.node_get)
app.command()(blocks.submit)
app.command()(blocks.get)
app.command("list")(blocks.list_blocks)
app.command()(blocks.scale)
app.command()(blocks.reassign)
app.command()(blocks.move)
app.command()(blocks.delete)
app.command()(state.watch)
app.command("console")(console.console_)
app.command()(blocks.top)
app.command("prometheus-config")(servers.prometheus_config)
app.command()(state.replay)
app.add_typer(dlq.app, name="dlq")
app.command()(state.explain)
policy_app.command("run")(policy.policy_run)
policy_app.command("add")(policy.policy_add)
policy_app.command("test")(policy.policy_test)
policy_app.command("input")(policy.policy_input)
policy_app.command("list")(policy.policy_list)
policy_app.command("show")(policy.policy_show)
app.command("subjects")(state.subjects_)
app.command("asyncapi")(state.asyncapi_)
app.command("settings")(servers.settings_)
app.command()(state.recover)
app.command()(state.check)
state_app.command("digest")(state.state_digest)
priority_class_app.command("add")(priority.priority_class_add)
priority_class_app.command("list")(priority.priority_class_list)
priority_class_app.command("remove")(priority.priority_class_remove)
quota_app.command("set")(priority.quota_set)
quota_app.command("get")(priority.quota_get)
quota_app.command("list")(priority.quota_list)
app.command("preempt")(priority.preempt)
app.add_typer(tenants.tenant_app, name="tenant")
app.add_typer(sidecar_auth.app, name="sidecar-auth")
app.add_typer(observers.app, name="observer")
app.command("rebalance")(rebalance.rebalance)
vcluster.register(app, DataDir)
nodes.register(node_app, cluster_app, DataDir)
trace.register(app, cluster_app, DataDir)
