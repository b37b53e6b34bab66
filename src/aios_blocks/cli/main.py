"""The ``blocks`` command (typer + rich)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ..urls import mask
from ..workers.locate import DEFAULT_DATA_DIR, find_data_dir

if TYPE_CHECKING:
    from rich.table import Table

    from ..workers.supervisor import Supervisor
    from .client import Client, Request

# Start-up: this module is the `blocks` entry point, so it imports only typer and rich at the top;
# every other module (the NATS and Redis clients, pydantic models, policies, ...) is imported by the
# command that needs it (tests/unit/test_cli_imports.py holds it to that).

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
app.add_typer(component_app, name="component")
app.add_typer(cluster_app, name="cluster")
app.add_typer(node_app, name="node")
app.add_typer(policy_app, name="policy")

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: commands that start servers: their data dir is never searched for, it is made where they say
_SERVER_COMMANDS = ("up", "demo")
#: the demo's own data dir: what it leaves behind stays apart from a `blocks up`'s (never nested in it)
DEMO_DATA_DIR = Path(".aios-demo")
#: where the data dir came from, for the "No servers" message
_LOOKED: list[str] = []


def _data_dir(ctx: typer.Context, value: Path | None) -> Path:
    """``--data-dir``, else ``AIOS_DATA_DIR`` (typer reads it), else ``./.aios-data``; a command
    that talks to a running system also finds ``.aios-data`` in a parent directory (as git finds
    ``.git``), so it works from anywhere inside the project. ``--data-dir`` is taken before the
    command too (``blocks --data-dir X list``); the one after it wins."""
    _LOOKED.clear()
    before = ctx.find_root().params.get("data_dir")
    source = getattr(ctx.get_parameter_source("data_dir"), "name", None)  # (click's enum; typer may vendor click)
    if before is not None and (value is None or source != "COMMANDLINE"):
        value = before
    if value is not None:
        source = "AIOS_DATA_DIR" if os.environ.get("AIOS_DATA_DIR") and Path(os.environ["AIOS_DATA_DIR"]) == value else "--data-dir"
        _LOOKED.append(f"{value} ({source})")
        return value
    if ctx.info_name in _SERVER_COMMANDS:
        return DEMO_DATA_DIR if ctx.info_name == "demo" else DEFAULT_DATA_DIR
    found = find_data_dir()
    _LOOKED.append(f"./{DEFAULT_DATA_DIR} and every parent directory of {Path.cwd()}")
    return found or DEFAULT_DATA_DIR


@app.callback()
def _root(
    data_dir: Path = typer.Option(
        None, "--data-dir", metavar="PATH", show_default=False,
        help="Data dir of the embedded servers, for every command (as after the command: else AIOS_DATA_DIR, "
        "else ./.aios-data, searched up from here).",
    ),
) -> None:
    # (no docstring: the app's help is Typer(help=...)); the value is read by each command's --data-dir
    pass


DataDir = typer.Option(
    None, "--data-dir", envvar="AIOS_DATA_DIR", callback=_data_dir, show_default="./.aios-data",
    help="Data dir of the embedded servers (else AIOS_DATA_DIR, else ./.aios-data, searched up from here).",
)
ProcessPerKind = typer.Option(
    False, "--process-per-kind", envvar="AIOS_PROCESS_PER_KIND",
    help="Run each worker kind in a process of its own (default: grouped in three processes, less memory).",
)


def _seconds_over(low: float = 0.0, inclusive: bool = False) -> Callable[[float | None], float | None]:
    """A typer callback: a number of seconds above ``low`` (or at it, ``inclusive``), finite
    (``nan`` and ``inf`` pass click's own ``min``)."""

    def check(value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value < low or (value == low and not inclusive)):
            raise typer.BadParameter(f"expected seconds {'>=' if inclusive else '>'} {low:g}, got {value}")
        return value

    return check


def _block_id(value: str | None) -> str | None:
    """A typer callback: a valid block id (refused before anything is sent, as every command does)."""
    if value is not None:
        from ..schemas.spec import check_id

        try:
            check_id(value, "block id")
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def _plain(*values: Any) -> list[str]:
    """Table cells of data (ids, reasons, labels, a user's strings): shown as they are, never read
    as Rich markup (``x[ocr]y`` stays ``x[ocr]y``)."""
    return [escape(str(v)) for v in values]


def _quiet_library_logs() -> None:
    """CLI output is for people: library logs go to stderr, warnings and up only. Called once the
    library is imported (structlog comes with it: a command that never loads it skips its import)."""
    structlog = sys.modules.get("structlog")
    if structlog is None:
        return
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(30),
    )


def _run(coro: Awaitable[T]) -> T:
    """Run a command's coroutine; a server it cannot reach is a one-line error (exit 2), not a
    traceback nor a hang."""
    import asyncio

    _quiet_library_logs()
    try:
        return asyncio.run(coro)  # type: ignore[arg-type]
    except ConnectionError as exc:  # Unreachable (NATS), refused or reset connections
        err.print(f"[red]Cannot reach the servers[/]: {escape(mask(str(exc)))}")
        raise typer.Exit(2) from None


def _urls(data_dir: Path, role: str | None = None) -> tuple[str, str]:
    """URLs from the environment, else a running ``blocks up``'s with ``role``'s credentials
    (default ``AIOS_ROLE``, else the admin)."""
    from ..workers import lifetime
    from ..workers.locate import resolve_urls

    try:
        urls = resolve_urls(data_dir, role)
    except (OSError, KeyError) as exc:
        err.print(f"[red]Cannot read the credentials of the servers in {data_dir}[/]: {type(exc).__name__}")
        raise typer.Exit(2)
    if urls is None:
        looked = "; ".join(_LOOKED) or str(data_dir)
        err.print(
            f"[red]No servers.[/] No running `blocks up` found in {escape(looked)} (no endpoints.json). "
            "Start one with [bold]blocks up[/], pass [bold]--data-dir[/] or set AIOS_DATA_DIR, "
            "or set AIOS_NATS_URL and AIOS_REDIS_URL."
        )
        raise typer.Exit(2)
    if not (os.environ.get("AIOS_NATS_URL") and os.environ.get("AIOS_REDIS_URL")) and not lifetime.in_use(data_dir):
        err.print(f"[red]No servers.[/] {escape(str(data_dir))}/endpoints.json is left from a `blocks up` that is no "
                  "longer running (nothing holds its lock): start it again with [bold]blocks up[/].")
        raise typer.Exit(2)
    return urls


async def _with_client(data_dir: Path, fn: Callable[[Client], Awaitable[T]]) -> T:
    from .client import Client

    _quiet_library_logs()
    nats_url, redis_url = _urls(data_dir)
    client = await Client.open(nats_url, redis_url)
    try:
        return await fn(client)
    finally:
        await client.close()


class _StoreOnly:
    """What a command that only reads Redis gets as ``c``: ``c.store``, and no NATS connection
    (nor the stream set-up every NATS client makes)."""

    def __init__(self, store: Any) -> None:
        self.store = store


async def _with_store(data_dir: Path, fn: Callable[[Any], Awaitable[T]]) -> T:
    from ..state.store import Store

    _quiet_library_logs()
    _, redis_url = _urls(data_dir)
    store = Store.open(redis_url)
    try:
        await store.reachable()
        return await fn(_StoreOnly(store))
    finally:
        await store.close()


def _load(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        err.print(f"[red]cannot read {path}: {exc}[/]")
        raise typer.Exit(2)
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc)
        err.print(f"[red]{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}[/]: {escape(where + ' '.join(str(what).split()))}")
        raise typer.Exit(2)
    if not isinstance(doc, dict):
        err.print(f"[red]{path} must hold an object[/]")
        raise typer.Exit(2)
    return doc


def _call(data: dict[str, Any]) -> str:
    """One policy call's record, on one line (its log lines below it)."""
    detail = f"{data.get('kind')}.{data.get('action')} {data.get('uri')}"
    detail += f"@v{data['version']}" if data.get("version") else ""
    detail += f" {data.get('duration_us', 0)}µs" + (f" error={data['error']}" if data.get("error") else "")
    for level, text in data.get("logs") or []:
        detail += f"\n    [{level}] {text}"
    return detail


def _answer(data: dict[str, Any], indent: str) -> str:
    """One cluster's dry_run answer: score, error, why nodes were rejected, affinity scores, its policy calls."""
    detail = f"cluster={data.get('cluster_id')} score={data.get('score')}" + (f" error={data['error']}" if data.get("error") else "")
    for node, why in (data.get("rejected_nodes") or {}).items():
        detail += f"\n    {indent}{node}: {why}"
    if data.get("node_scores"):
        detail += f"\n    {indent}affinity scores: " + ", ".join(f"{n}={v:g}" for n, v in data["node_scores"].items())
    if (data.get("adapt") or {}).get("nodes"):
        detail += f"\n    {indent}adapt: " + _adapt_line(data["adapt"])
    if indent:  # inside a post_dry_run: the answer's own policy calls (the event's are listed after it)
        for call in data.get("decisions") or []:
            detail += f"\n    {indent}policy " + _call(call)
    return detail


def _line(subject: str, env: dict[str, Any]) -> str:
    from .client import event_data

    data = event_data(env)
    kind = subject.split(".", 3)[3] if subject.count(".") >= 3 else subject
    detail = ""
    if kind == "selection":
        detail = f"candidates={data.get('candidates')} filtered={data.get('filtered') or {}}"
    elif kind == "dry_run.result":  # stored apart by versions before answers went into post_dry_run
        detail = _answer(data, "")
    elif kind == "post_dry_run":
        detail = f"chosen={data.get('cluster_id') or '-'} scores={data.get('scores')}" + (f" missing={data['missing']}" if data.get("missing") else "")
        for a in data.get("answers") or []:  # each cluster's dry_run answer, with its policy calls
            if isinstance(a, dict):
                detail += "\n    dry_run " + _answer(a, "    ")
    elif kind == "placement":
        detail = ", ".join(f"{p['instance_id']}@{p['node_id']}{p['gpus']}" for p in data.get("placements", []))
        for p in data.get("placements", []):
            for a in p.get("adaptive") or []:
                detail += f"\n    {p['instance_id']} entry {a['entry']} (Adaptive): base {a['base']:g} -> {a['weight']:g}: {a['why']}"
    elif kind in ("ready", "failed", "deleted"):
        detail = data.get("reason") or f"instances={data.get('instances')}"
    elif kind == "rejected":
        detail = "; ".join(f"{e['path']}: {e['message']}" for e in data.get("errors", []))
    elif kind.endswith("failed"):
        detail = data.get("reason", "")
    elif kind == "decision":
        detail = _call(data)
    elif kind.startswith("instance."):
        detail = f"node={data.get('node_id')} gpus={data.get('gpus')}" + (f" reason={data['reason']}" if data.get("reason") else "")
        if data.get("endpoint"):
            detail += f" at {data['endpoint']}"
    if kind != "decision":
        for call in data.get("decisions") or []:
            detail += "\n    policy " + _call(call)
    colour = {"ready": "green", "failed": "red", "rejected": "red", "deleted": "yellow"}.get(kind.rsplit(".", 1)[-1], "cyan")
    return f"[{colour}]{kind:<32}[/] {escape(detail)}"


# -- parsing user input: a mistake is one line and exit 2, never a traceback ------------------------
def _labels(values: list[str], option: str = "--label") -> dict[str, str]:
    """``["k=v", ...]`` -> dict; anything else is a usage error naming the option."""
    out = {}
    for kv in values:
        key, eq, value = kv.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {kv!r}", param_hint=option)
        out[key.strip()] = value
    return out


def _json_option(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON ({exc})", param_hint=option) from None
    if not isinstance(value, dict):
        raise typer.BadParameter("expected a JSON object", param_hint=option)
    return value


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _seconds(text: str, option: str) -> float:
    """``90``, ``30s``, ``30m``, ``2h``, ``1d`` -> seconds."""
    unit = text[-1:] if text[-1:] in _UNITS else "s"
    number = text[:-1] if text[-1:] in _UNITS else text
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise typer.BadParameter(f"expected seconds or a duration like 30m, 2h, 1d; got {text!r}", param_hint=option)
    return value * _UNITS[unit]


def _one_line(exc: BaseException) -> str:
    """A user-facing message: pydantic's list of problems on one line, else the exception's text."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
    return str(exc.args[0]) if len(exc.args) == 1 else str(exc)


def _input_errors() -> tuple[type[Exception], ...]:
    """Bad input: ValueError, OSError and yaml's error, when a command loaded yaml (only those that
    read files import it)."""
    yaml = sys.modules.get("yaml")
    return (ValueError, OSError, yaml.YAMLError) if yaml is not None else (ValueError, OSError)


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
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if message.strip():  # (no arguments at all: the help was printed, nothing to add)
            err.print(f"[red]error:[/] {escape(message)}{hint}")
        sys.exit(int(getattr(exc, "exit_code", 2)))
    except TimeoutError as exc:  # a request the server refused is never answered: say which, if so
        if os.environ.get("AIOS_DEBUG"):
            raise
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


# -- servers and workers ----------------------------------------------------------------------
@app.command()
def up(
    data_dir: Path = DataDir,
    parsers: int = typer.Option(1, min=0, help="Parser workers (copies: the first in its group's process, each other its own)."),
    gateways: int = typer.Option(1, min=0, help="Gateway workers (copies, like --parsers)."),
    controllers: int = typer.Option(1, min=0, help="Controller workers (copies, like --parsers)."),
    agents: int = typer.Option(1, min=0, help="Simulated node agents (copies, like --parsers)."),
    executors: int = typer.Option(1, min=0, help="Executors (copies, like --parsers; block tasks over NATS and HTTP; they share the HTTP port)."),
    collectors: int = typer.Option(1, min=0, help="Metrics collectors (copies, like --parsers; one writes, copies stand by; docs/metrics.md)."),
    autoscalers: int = typer.Option(1, min=0, help="Autoscalers (copies, like --parsers; each block decided by the one holding its lease; docs/autoscaling.md)."),
    checkers: int = typer.Option(1, min=0, help="Health checkers (copies, like --parsers; one decides a block at a time; docs/health.md)."),
    process_per_kind: bool = ProcessPerKind,
) -> None:
    """Start the embedded NATS+Redis (unless AIOS_*_URL are set) and every worker. Ctrl-C,
    SIGTERM or SIGHUP stop everything in order; if this process is killed outright, its servers
    and workers die with it. One `blocks up` per data dir: a second one exits 1 naming the first.

    The worker kinds run grouped, three processes: front (parser, gateway and the services that
    watch running blocks: metrics, autoscaler, checker), the controller on its own, and serve
    (agent-sim, executor); each kind keeps its own connections as its own role, and a group whose
    kind fails is restarted whole. `--controllers N` etc. run N copies of a kind: the first in its
    group, the others as processes of their own.
    `--process-per-kind` runs each kind in a process of its own.

    Example: `blocks up --controllers 2`, `blocks up --data-dir /var/lib/aios &`
    """
    from . import up as _up

    layout = {"parser": parsers, "gateway": gateways, "controller": controllers, "agent-sim": agents, "executor": executors,
              "metrics": collectors, "autoscaler": autoscalers, "checker": checkers}
    # the process that stays up is a lean one (cli/up.py): this one's modules would stay resident
    _up.exec_up(data_dir, layout, process_per_kind)


@app.command()
def task(
    bid: str = typer.Argument(..., help="Block id.", callback=_block_id),
    data: str = typer.Option("{}", "--data", "-d", help="The task's body: JSON text, or @FILE (any bytes)."),
    idempotent: bool = typer.Option(False, "--idempotent", help="Mark the task idempotent: it may be retried on another instance."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for the answer.", callback=_seconds_over()),
    data_dir: Path = DataDir,
) -> None:
    """Send one task to a block over NATS (through an executor) and print the answer. Exit 0
    answered (2xx), 1 unknown block, 2 bad input, 3 failed (the instance's or executor's error,
    e.g. overloaded: retry after the time printed), 5 timed out.

    Example: `blocks task blk-1234 --data '{"prompt": "hi"}'`, `blocks task blk-1234 -d @image.png`
    """
    if data.startswith("@"):
        try:
            body = Path(data[1:]).read_bytes()
        except OSError as exc:
            err.print(f"[red]cannot read {escape(data[1:])}: {exc}[/]")
            raise typer.Exit(2)
        ctype = "application/json" if data.endswith(".json") else "application/octet-stream"
    else:
        try:
            json.loads(data)
        except ValueError as exc:
            err.print(f"[red]--data is not JSON[/]: {escape(str(exc))} (use @FILE for other bodies)")
            raise typer.Exit(2)
        body, ctype = data.encode(), "application/json"
    headers = {"Content-Type": ctype, "Aios-Timeout-Ms": str(int(timeout * 1000))}
    if idempotent:
        headers["Aios-Idempotent"] = "true"

    from ..bus.nats_bus import Bus
    from .client import CONNECT_WAIT_S, send_task

    nats_url, _ = _urls(data_dir)  # NATS only: AIOS_ROLE=upstream works

    async def go() -> tuple[int, bytes, dict[str, str]]:
        bus = await Bus.open(nats_url, source="aios-blocks/cli", first_wait_s=CONNECT_WAIT_S)
        try:
            return await send_task(bus, bid, body, headers, timeout + 1)
        finally:
            await bus.close()

    try:
        status, out, h = _run(go())
    except TimeoutError:
        err.print(f"[red]timed out[/]: no answer from block {escape(bid)} within {timeout:g} s (is an executor running?)")
        raise typer.Exit(5)
    if 200 <= status < 300:
        sys.stdout.buffer.write(out)
        if out and not out.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
        raise typer.Exit(0)
    why = h.get("Aios-Error") or out.decode(errors="replace")[:2000]
    retry = f" (retry after {h['Retry-After-Ms']} ms)" if h.get("Retry-After-Ms") else ""
    err.print(f"[red]{status}[/] {escape(why)}{retry}")
    raise typer.Exit(1 if status == 404 and "Aios-Instance" not in h else 5 if status == 504 else 3)


@app.command()
def worker(
    kind: str = typer.Argument(..., help="parser | gateway | controller | agent-sim | executor | metrics | autoscaler | checker"),
    cluster: str = typer.Option(None, help="controller: serve just this cluster (its own durable); executor: serve just its blocks' tasks; metrics: collect just its blocks; autoscaler: decide just its blocks."),
    data_dir: Path = DataDir,
) -> None:
    """Run one worker in the foreground: AIOS_NATS_URL and AIOS_REDIS_URL, else the servers of a
    running `blocks up`, connected as the worker's own role (like the workers `blocks up` runs).

    Example: `AIOS_NATS_URL=nats://10.0.0.5:4222 AIOS_REDIS_URL=redis://10.0.0.6 blocks worker controller --cluster c1`
    """
    from ..settings import load as load_settings
    from ..workers.auth import KIND_ROLE
    from ..workers.main import KINDS, configure_logging, run_worker, tune_gc

    if kind not in KINDS:
        err.print(f"[red]unknown worker kind {escape(kind)!r}[/]: one of {', '.join(KINDS)}")
        raise typer.Exit(2)
    nats_url, redis_url = _urls(data_dir, KIND_ROLE[kind])
    if cluster and kind == "controller" and not os.environ.get("AIOS_NATS_URL"):
        from ..workers.auth import protect_controller

        protect_controller(data_dir, cluster)  # observers may not touch its durable controller-<cid>
    configure_logging()
    tune_gc(load_settings().gc_gen0_threshold)
    _run(run_worker(kind, nats_url, redis_url, cluster))


@app.command()
def agent(
    node_id: str = typer.Option(..., "--node-id", help="This node's id (a subject token: letters, digits, - and _)."),
    cluster: str = typer.Option(..., "--cluster", help="The cluster this node belongs to (registered if new)."),
    runtime: str = typer.Option("docker", help="docker | process | sim"),
    label: list[str] = typer.Option([], "--label", "-l", help="Node label key=value (repeatable)."),
    zone: str = typer.Option(None, help="Shorthand for --label zone=..."),
    rack: str = typer.Option(None, help="Shorthand for --label rack=N: a number, what RackId affinity matches (docs/affinity.md)."),
    trust_domain: str = typer.Option(None, "--trust-domain", help="Shorthand for --label trust-domain=... (Trust affinity)."),
    cpu: float = typer.Option(None, help="CPUs to offer (default: this host's)."),
    memory: int = typer.Option(None, help="Memory to offer, MiB (default: this host's)."),
    sim_gpus: int = typer.Option(None, "--sim-gpus", help="Offer N simulated GPUs instead of reading NVML."),
    heartbeat_s: float = typer.Option(2.0, "--heartbeat-s", help="Seconds between heartbeats.", callback=_seconds_over()),
    metrics_port: int = typer.Option(0, "--metrics-port", help="Serve Prometheus metrics on 127.0.0.1:PORT (0: off)."),
    agent_dir: Path = typer.Option(Path(".aios-data/agent"), "--agent-dir", help="Working directories of instances."),
    advertise_host: str = typer.Option("127.0.0.1", "--advertise-host", help="Host part of instance endpoints (http://HOST:PORT): an address the executors reach this node at."),
    data_dir: Path = DataDir,
) -> None:
    """Run the node agent of one node: start/stop its instances, heartbeat, report faults.

    Needs only NATS: AIOS_NATS_URL, or a local `blocks up` (then it connects as user `agent-<node id>`,
    which may publish only this node's subjects; AIOS_AUTH=0 servers need none). GPUs come from NVML when a driver is
    present (`nvidia-ml-py`), else none, or `--sim-gpus N`.

    Example (GPU host): `AIOS_NATS_URL=nats://10.0.0.5:4222 blocks agent --node-id gpu-7 --cluster eu-1 --runtime docker --rack 3 --zone eu-1a`
    """
    from ..schemas.spec import Node
    from ..settings import load as load_settings
    from ..workers.agent.main import AgentOptions, run_agent
    from ..workers.embedded import agent_nats_url
    from ..workers.main import configure_logging, tune_gc

    labels = _labels(label)
    for key, value in (("zone", zone), ("rack", rack), ("trust-domain", trust_domain)):
        if value is not None:
            labels[key] = value
    try:
        Node(id=node_id, cluster=cluster, labels=labels)
    except Exception as exc:
        err.print(f"[red]invalid node[/]: {escape(_one_line(exc))}")
        raise typer.Exit(2)
    try:  # with a local `blocks up`: as user agent-<node id>, added to the server on first use
        nats_url = agent_nats_url(data_dir, node_id)
    except (OSError, KeyError, RuntimeError) as exc:
        err.print(f"[red]Cannot get the credentials of node {escape(node_id)} from {data_dir}[/]: "
                  f"{type(exc).__name__}: {escape(mask(str(exc)))}")
        raise typer.Exit(2)
    if not nats_url:
        err.print("[red]No NATS.[/] Set AIOS_NATS_URL (the agent needs only NATS) or run `blocks up` here.")
        raise typer.Exit(2)
    configure_logging()
    tune_gc(load_settings().gc_gen0_threshold)
    opts = AgentOptions(
        node_id=node_id, cluster=cluster, runtime=runtime, labels=labels, cpu=cpu, memory=memory, sim_gpus=sim_gpus,
        data_dir=agent_dir, heartbeat_s=heartbeat_s, metrics_port=metrics_port, advertise_host=advertise_host,
        drain_grace_s=load_settings().drain_grace_s,
    )

    async def go() -> None:
        from ..workers.base import stop_on_signals

        await run_agent(opts, nats_url, stop_on_signals())

    try:
        _run(go())
    except Exception as exc:  # e.g. no Docker engine
        err.print(f"[red]agent failed[/]: {escape(str(exc))}")
        raise typer.Exit(1)


@app.command()
def demo(
    data_dir: Path = DataDir,
    timeout: float = typer.Option(120, help="Give up after this many seconds.", callback=_seconds_over()),
    process_per_kind: bool = ProcessPerKind,
) -> None:
    """Start everything, register an example component and 3 simulated clusters x 8 nodes x 8 GPUs,
    submit an example block and show its lifecycle until it is ready.

    On a terminal it keeps running (Ctrl-C stops); otherwise it exits 0 once the block is ready.
    Its servers stop with it, but its stream and state stay in its own data dir (`./.aios-demo`
    unless --data-dir says otherwise, apart from a `blocks up`'s `./.aios-data`): it prints the
    commands that start them again and replay the block.
    Example: `blocks demo`
    """
    import shlex

    from . import up as _up

    code, bid = 1, None
    with _up.running(data_dir, process_per_kind=process_per_kind) as (_, sup):
        code, bid = _run(_demo(sup, timeout, Path(data_dir)))
        if code == 0 and sys.stdout.isatty():
            where = "" if data_dir == DEMO_DATA_DIR else f" --data-dir {shlex.quote(str(data_dir))}"
            console.print(f"[dim]demo is up; Ctrl-C to stop (other terminals: blocks list{where} / watch / scale)[/]")
            while True:
                time.sleep(1)
    if bid is not None:
        dd = shlex.quote(str(data_dir))
        console.print(escape(f"the demo's servers stopped; its stream and state stay in {data_dir}. To look at block {bid} again:"))
        console.print(escape(f"  blocks up --data-dir {dd} &"))
        console.print(escape(f"  blocks replay {bid} --data-dir {dd}    (or: blocks explain / get {bid} --data-dir {dd})"))
    raise typer.Exit(code)


async def _demo(sup: Supervisor, timeout: float, data_dir: Path) -> tuple[int, str | None]:
    """The demo's exit code, and its block's id (None: none was submitted)."""
    import yaml

    from .client import TERMINAL, Client

    _quiet_library_logs()
    client = await Client.open(sup.nats_url, sup.redis_url)
    try:
        comp = await client.add_component(yaml.safe_load((EXAMPLES / "component.yaml").read_text()))
        for i in range(3):
            await client.add_sim_cluster(f"cluster-{i}", nodes=8, gpus=8, labels={"region": f"r{i}"})
        console.print(f"registered component [bold]{comp.componentURI}[/] and 3 clusters x 8 nodes x 8 GPUs")
        spec = yaml.safe_load((EXAMPLES / "block.yaml").read_text())
        started = time.perf_counter()
        bid = await client.submit(spec)
        console.print(f"submitted block [bold]{bid}[/]")
        try:
            kind, _ = await client.wait(
                bid, timeout, on_event=lambda s, e: console.print(f"{time.perf_counter() - started:7.3f}s  {_line(s, e)}")
            )
        except TimeoutError:
            err.print(f"[red]block {bid} not ready after {timeout}s[/]")
            return 1, bid
        await _print_block(client, bid)
        if kind == "ready":
            console.print(f"[green bold]block {bid} ready[/] in {time.perf_counter() - started:.3f}s")
            await _demo_tasks(client, bid, data_dir)
        return TERMINAL[kind], bid
    finally:
        await client.close()


async def _demo_tasks(client: Client, bid: str, data_dir: Path) -> None:
    """Tasks through the executor: a few to the example block (simulated instances echo them),
    then the OCR block's images when the `ocr` extra is installed (a real model)."""
    import asyncio

    async with asyncio.timeout(30):  # the mapper's map reaches the executor just after `ready`
        while True:
            if (await client.task(bid, b"{}", timeout=10))[0] == 200:
                break
            await asyncio.sleep(0.1)
    for n in range(3):
        status, body, h = await client.task(bid, json.dumps({"prompt": f"task {n}"}).encode(), {"Content-Type": "application/json"})
        console.print(escape(f"task {n} -> {status} from {h.get('Aios-Instance', '?')}: {body.decode(errors='replace')[:120]}"))
    from ..examples.ocr import available
    from ..examples.ocr import demo as ocr_demo

    why = available()
    if why:
        console.print(f"[dim]OCR block skipped: {escape(why)}[/]")
        return

    async def send(obid: str, task: dict[str, Any]) -> dict[str, Any]:
        status, body, h = await client.task(obid, json.dumps(task).encode(), {"Content-Type": "application/json"}, 120)
        if status != 200:
            raise RuntimeError(f"executor answered {status}: {h.get('Aios-Error') or body[:200]!r}")
        out: dict[str, Any] = json.loads(body)
        return out

    async def via_executor(obid: str, task: dict[str, Any]) -> dict[str, Any]:
        async with asyncio.timeout(60):  # as above: the OCR block's map reaches the executor
            while True:
                try:
                    return await send(obid, task)
                except RuntimeError as exc:
                    if "404" not in str(exc) and "no ready instance" not in str(exc):
                        raise
                await asyncio.sleep(0.2)

    await ocr_demo.run(client, data_dir, send=via_executor, say=lambda line: console.print(line))


# -- the shipped examples ---------------------------------------------------------------------
#: what the JSON examples are (they cannot carry a comment)
_EXAMPLE_NOTES = {
    "allocation_input.json": "what a resourceAllocator got for `allocation` (blocks policy run --input)",
    "dry_run_input.json": "what a resourceAllocator got for `dry_run` (blocks policy run --input)",
    "lxd_args.json": "LXD's scriptlet arguments (blocks policy run --kind lxd --input)",
}


def _example_files() -> list[Path]:
    """The example files shipped in the package (``aios_blocks/examples``; the repository's
    ``examples/`` is a link to it): specs, components, policies and recorded inputs."""
    return sorted(p for p in EXAMPLES.iterdir() if p.is_file() and p.suffix in (".yaml", ".json", ".star", ".py")
                  and not p.name.startswith("__"))


def _example_note(path: Path) -> str:
    """The example's first comment line (or its entry in ``_EXAMPLE_NOTES``)."""
    if path.name in _EXAMPLE_NOTES:
        return _EXAMPLE_NOTES[path.name]
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


@app.command("examples")
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


# -- inventory --------------------------------------------------------------------------------
@component_app.command("add")
def component_add(file: Path, data_dir: Path = DataDir) -> None:
    """Register (or replace) a component from YAML/JSON.

    Example: `blocks component add examples/component.yaml` (from an installed wheel, `blocks
    examples --copy examples` writes the examples there first)
    """
    from pydantic import ValidationError

    from ..schemas.ir import pydantic_errors

    doc = _load(file)
    try:
        comp = _run(_with_client(data_dir, lambda c: c.add_component(doc)))
    except ValidationError as exc:
        for e in pydantic_errors(exc):
            err.print(f"[red]{e.path}[/]: {e.message}")
        raise typer.Exit(4)
    console.print(f"component [bold]{comp.componentURI}[/] registered")


#: columns of ids: never wrapped (an id cut in two cannot be copied), the other columns give way
ID_COLUMNS = frozenset({"file", "block", "instance", "node", "cluster", "component", "virtual cluster", "node rejected", "name", "variable"})


def _table(*cols: str, title: str | None = None) -> Table:
    """A table that wraps long cells instead of cutting them (piped, or at 80 columns), except in
    id columns (``ID_COLUMNS``), which stay on one line."""
    from rich.table import Table

    t = Table(title=title)
    for col in cols:
        if col in ID_COLUMNS:
            t.add_column(col, no_wrap=True, overflow="ignore")
        else:
            t.add_column(col, overflow="fold")
    return t


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


@component_app.command("list")
def component_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """List registered components: URI, image, resources per instance, policies.

    Example: `blocks component list`, `blocks component list --json`
    """

    async def go(c: Client) -> dict[str, dict[str, Any]]:
        return await c.store.components()

    comps = _run(_with_store(data_dir, go))
    if as_json:
        _print_json(comps)
        return
    t = _table("component", "image", "resources", "policies")
    for uri, comp in comps.items():
        res = comp.get("resources") or {}
        t.add_row(*_plain(uri, comp.get("image", ""), ", ".join(f"{k}={v}" for k, v in res.items()),
                          ", ".join(f"{p.get('name')}={p.get('policyRuleURI')}" for p in comp.get("policies") or [])))
    console.print(t)


@cluster_app.command("list")
def cluster_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """List clusters with their labels, node count and free GPUs.

    Example: `blocks cluster list`
    """

    async def go(c: Client) -> list[dict[str, Any]]:
        out = []
        for cid, cluster in sorted((await c.store.clusters()).items()):
            nodes = await c.store.read_nodes(cid, await c.store.node_ids(cid))
            gpus = [g for n in nodes.values() for g in n["gpus"]]
            out.append({"id": cid, "labels": cluster.get("labels", {}), "nodes": len(nodes),
                        "healthy_nodes": sum(1 for n in nodes.values() if n["healthy"]),
                        "gpus": len(gpus), "gpus_free": sum(1 for g in gpus if g["instances"] == 0)})
        return out

    rows = _run(_with_store(data_dir, go))
    if as_json:
        _print_json(rows)
        return
    t = _table("cluster", "labels", "nodes (healthy)", "GPUs free / total")
    for r in rows:
        t.add_row(*_plain(r["id"], ", ".join(f"{k}={v}" for k, v in r["labels"].items()), f"{r['nodes']} ({r['healthy_nodes']})",
                          f"{r['gpus_free']} / {r['gpus']}"))
    console.print(t)


@node_app.command("list")
def node_list(
    cluster: str = typer.Option(None, "--cluster", "-c", help="Only this cluster's nodes."),
    as_json: bool = typer.Option(False, "--json"),
    data_dir: Path = DataDir,
) -> None:
    """List nodes: cluster, node type (what virtual clusters' replica sets count: the `nodeType`
    label, else the first GPU's model), health (`suspect`: every instance on it fails its probes
    and its agent is silent, no placement goes there; docs/health.md), free CPU and memory, GPUs
    in use, labels. `--json` gives each node's `node_type` and `suspect` (its mark, or null) too.

    Example: `blocks node list --cluster c1`
    """

    async def go(c: Client) -> list[dict[str, Any]]:
        cids = sorted(await c.store.clusters())
        if cluster is not None:
            if cluster not in cids:
                raise LookupError(f"no cluster {cluster!r} (known: {', '.join(cids) or 'none'})")
            cids = [cluster]
        out: list[dict[str, Any]] = []
        for cid in cids:
            out += (await c.store.read_nodes(cid, await c.store.node_ids(cid))).values()
        suspect = await c.store.health.suspects()
        for n in out:
            n["suspect"] = suspect.get(n["node_id"])
        return out

    from ..schemas.vcluster import node_type

    nodes = _request(go, data_dir, store_only=True)
    for n in nodes:
        n["node_type"] = node_type(n)
    if as_json:
        _print_json(nodes)
        return
    t = _table("node", "cluster", "type", "healthy", "CPU free", "memory free (MiB)", "GPUs in use", "labels")
    for n in nodes:
        busy = sum(1 for g in n["gpus"] if g["instances"])
        health = ("[yellow]suspect[/]" if n["suspect"] else "yes") if n["healthy"] else "[red]no[/]"
        t.add_row(escape(n["node_id"]), escape(n["cluster"]), escape(n["node_type"]), health,
                  f"{n['cpu_free']:g} / {n['cpu']:g}", f"{n['memory_free']} / {n['memory']}", f"{busy} / {len(n['gpus'])}",
                  escape(", ".join(f"{k}={v}" for k, v in n["labels"].items())))
    console.print(t)


@cluster_app.command("add")
def cluster_add(
    cluster_id: str,
    label: list[str] = typer.Option([], "--label", "-l", help="key=value, repeatable."),
    nodes: int = typer.Option(None, min=1, help="Also add this many simulated nodes (at least 1)."),
    gpus: int = typer.Option(8, min=0, help="GPUs per simulated node."),
    gpu_memory: int = typer.Option(81920, min=1, help="MiB per simulated GPU."),
    node_type: str = typer.Option(None, "--node-type", help="nodeType label of the simulated nodes (virtual clusters' replica sets)."),
    node_label: list[str] = typer.Option([], "--node-label", help="key=value on every simulated node, repeatable."),
    data_dir: Path = DataDir,
) -> None:
    """Register a cluster, optionally with simulated nodes.

    Example: `blocks cluster add c1 -l region=eu --nodes 8 --gpus 8 --node-type A100`
    """
    labels = _labels(label)
    node_labels = _labels(node_label, "--node-label") | ({"nodeType": node_type} if node_type else {})
    from ..schemas.spec import Cluster, check_id

    check_id(cluster_id, "cluster id")

    async def go(c: Client) -> None:
        if nodes:
            await c.add_sim_cluster(cluster_id, nodes=nodes, gpus=gpus, gpu_memory=gpu_memory, labels=labels,
                                    node_labels=node_labels)
        else:
            await c.add_cluster(Cluster(id=cluster_id, labels=labels))

    _run(_with_client(data_dir, go))
    console.print(f"cluster [bold]{cluster_id}[/] registered ({nodes or 0} simulated nodes)")


@node_app.command("add")
def node_add(
    node_id: str,
    cluster: str = typer.Option(..., "--cluster", "-c"),
    gpus: int = typer.Option(8, min=0),
    gpu_memory: int = typer.Option(81920, min=1, help="MiB per GPU."),
    gpu_model: str = typer.Option("sim-gpu"),
    cpu: float = typer.Option(64, min=0),
    memory: int = typer.Option(512 * 1024, min=1, help="MiB."),
    label: list[str] = typer.Option([], "--label", "-l", help="key=value, repeatable."),
    data_dir: Path = DataDir,
) -> None:
    """Register a (simulated) node in a cluster.

    Example: `blocks node add n9 --cluster c1 --gpus 4 -l rack=2`
    """
    from ..schemas.spec import Gpu, Node, check_id

    check_id(node_id, "node id")
    check_id(cluster, "cluster id")
    node = Node(
        id=node_id, cluster=cluster, cpu=cpu, memory=memory, labels=_labels(label),
        gpus=[Gpu(id=f"{node_id}-g{i}", model=gpu_model, memory=gpu_memory) for i in range(gpus)],
    )
    _run(_with_client(data_dir, lambda c: c.add_node(node)))
    console.print(f"node [bold]{node_id}[/] registered in {cluster}")


# -- blocks -----------------------------------------------------------------------------------
@app.command()
def submit(
    file: Path,
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow the block until ready/failed/rejected."),
    timeout: float = typer.Option(120, help="With --wait: give up after this many seconds (exit 5).", callback=_seconds_over()),
    dry_run: bool = typer.Option(
        False, "--dry-run",
        help="Publish nothing: print where the block would be placed now, and the state index to submit with. "
        "Exit 0 it would place, 4 it would not (with why), 2 bad spec.",
    ),
    if_index: int = typer.Option(
        None, "--if-index", min=0, metavar="N",
        help="Submit only if the state index is still N (from --dry-run) right before publishing; else exit 1. "
        "A check, not a lock: changes after it are not covered.",
    ),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    data_dir: Path = DataDir,
) -> None:
    """Submit a block spec (YAML or JSON). Exit code with --wait: 0 ready, 3 failed, 4 rejected, 5 timeout;
    1 when --if-index finds the state changed.

    --wait follows only what answers this submission (events whose `gen` is this create's stream
    sequence): re-submitting an id in use prints the rejection and exits 4.

    --dry-run (Nomad's `job plan`) parses the spec as the parser does and runs the placement
    pipeline here against the current state (filter rule and selection, every candidate's dry_run,
    post_dry_run, the gang's allocation), with the block's policies but without saving their
    context, publishing anything or reserving anything. It prints the chosen cluster, each
    instance's node and GPUs, why each other cluster was left out, and the **state index** the
    plan was computed at (it moves with every reservation, release and node change). Give the
    spec a `blockId`: equal GPUs are picked by it, so a submit under another id may get others.

    --if-index N (Nomad's `-check-index`) then submits only if that index is unchanged, else
    exits 1: "state changed since index N (now M)". The check is made just before publishing; what
    changes after it (another block placed meanwhile, a node failing) is not covered, and the
    workers place the block on the state they find then: the plan is a forecast, not a reservation.

    Example: `blocks submit examples/block.yaml --wait`, `blocks submit examples/block.yaml --dry-run`,
    `blocks submit examples/block.yaml --if-index 42 --wait` (`blocks examples --copy examples`
    writes the shipped examples/ where there is none)
    """
    if dry_run and (wait or if_index is not None):
        raise typer.BadParameter("--dry-run publishes nothing: it takes neither --wait nor --if-index", param_hint="--dry-run")
    if as_json and not dry_run:
        raise typer.BadParameter("--json goes with --dry-run", param_hint="--json")
    spec = _load(file)
    if dry_run:
        raise typer.Exit(_dry_run(spec, file, as_json, data_dir))

    from .client import TERMINAL

    async def go(c: Client) -> int:
        req = await c.create(spec, if_index=if_index)
        console.print(f"submitted [bold]{req.bid}[/] (gen {req.seq})")
        if not wait:
            return 0
        try:
            _, kind, env = await c.outcome(req, timeout, on_event=lambda s, e: console.print(_line(s, e)))
        except TimeoutError:
            err.print(f"[red]timed out after {timeout}s[/]")
            return 5
        if kind == "rejected":
            for e in (env.get("data") or {}).get("errors", []):
                err.print(f"[red]rejected[/] {escape(str(e.get('path')))}: {escape(str(e.get('message')))}")
        return TERMINAL[kind]

    raise typer.Exit(_request(go, data_dir))


def _dry_run(spec: dict[str, Any], file: Path, as_json: bool, data_dir: Path) -> int:
    """``submit --dry-run``: 0 would place, 4 would not, 2 bad spec."""
    plan = _request(lambda c: c.plan(spec), data_dir)
    if as_json:
        _print_json(plan.as_dict())
    for e in plan.errors:
        err.print(f"[red]rejected[/] {escape(e.path)}: {escape(e.message)}")
    if plan.errors:
        return 2
    if not as_json:
        _render_plan(plan.as_dict(), file)
    return 0 if plan.places else 4


def _render_plan(p: dict[str, Any], file: Path) -> None:
    index = p["index"] if p["index"] >= 0 else "-"
    console.print(f"plan for block [bold]{escape(p['block_id'])}[/] at state index [bold]{index}[/]")
    t = _table("cluster", "outcome", "dry_run score", "fits", "detail")
    for cid, why in sorted(p["filtered"].items()):
        t.add_row(cid, "[yellow]filtered[/]", "", "", escape(why))
    for cid, d in p["dry_runs"].items():
        outcome = "[green]chosen[/]" if cid == p["cluster_id"] else "candidate"
        fits = str(d["placeable"]) if d["placeable"] >= 0 else "?"
        node = d["node_info"].get("node_id", "") if isinstance(d["node_info"], dict) else ""
        detail = f"[red]{escape(d['error'])}[/]" if d["error"] else (f"first instance on {escape(str(node))}" if node else "")
        t.add_row(cid, outcome, f"{d['score']:g}", fits, detail)
    console.print(t)
    rejected = [(cid, n, why) for cid, d in p["dry_runs"].items() for n, why in d["rejected_nodes"].items()]
    if rejected:
        r = _table("cluster", "node rejected", "why")
        for row in rejected:
            r.add_row(*(escape(str(x)) for x in row))
        console.print(r)
    for note in p["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if not p["places"]:
        err.print(f"[red]would not place[/] ({p['stage']}): {escape(p['failure'])}")
        return
    g = _table("instance", "node", "GPUs")
    for pl in p["placements"]:
        g.add_row(pl["iid"], pl["node"], ", ".join(pl["gpus"]) or "-")
    console.print(g)
    console.print(f"[green]would place[/] {len(p['placements'])} instance(s) on [bold]{escape(p['cluster_id'])}[/]")
    if p["index"] >= 0:
        console.print(f"submit it only if nothing changed meanwhile: blocks submit {escape(str(file))} --if-index {p['index']}")


async def _print_block(c: Client, bid: str) -> dict[str, Any] | None:
    block = await c.store.get_block(bid)
    if block is None:
        return None
    insts = await c.store.instances(bid)
    t = _table("instance", "node", "gpus", "status", "endpoint", title=escape(f"block {bid}: {block['status']}" + (f" ({block.get('reason')})" if block.get("reason") else "")))
    for iid, i in sorted(insts.items()):
        t.add_row(*_plain(iid, i["node"], ",".join(i["gpus"]), i["status"], i.get("endpoint") or ""))
    console.print(t)
    return block


@app.command()
def get(bid: str, as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """Show a block: status, cluster, instances.

    Example: `blocks get blk-1234 --json`
    """
    from ..schemas.spec import check_id

    check_id(bid, "block id")

    async def go(c: Client) -> int:
        if as_json:
            block = await c.store.get_block(bid)
            if block:
                block["instances"] = await c.store.instances(bid)
                print(json.dumps(block, indent=2, default=str))
        else:
            block = await _print_block(c, bid)
        if block is None:
            err.print(f"[red]no block {bid}[/]")
            return 1
        return 0

    raise typer.Exit(_run(_with_store(data_dir, go)))


@app.command("list")
def list_blocks(
    limit: int = typer.Option(100, min=1, help="At most this many blocks."),
    as_json: bool = typer.Option(False, "--json", help="The rows as a JSON list (id, status, cluster, reason, gen, instances)."),
    data_dir: Path = DataDir,
) -> None:
    """List blocks, newest first: status, cluster, instance count, reason. Reads Redis only.

    Example: `blocks list --limit 20`, `blocks list --json`
    """
    from ..state.views import block_rows, open_reader

    try:
        r = open_reader(_urls(data_dir)[1])
        try:
            rows = block_rows(r, limit)
        finally:
            r.close()
    except ConnectionError as exc:
        err.print(f"[red]Cannot reach the servers[/]: {escape(mask(str(exc)))}")
        raise typer.Exit(2) from None
    if as_json:
        _print_json(rows)
        return
    t = _table("block", "status", "cluster", "instances", "reason")
    for row in rows:
        t.add_row(*_plain(row["id"], row["status"], row["cluster"] or "", row["instances"], row["reason"] or ""))
    console.print(t)


def _request(fn: Callable[[Client], Awaitable[Any]], data_dir: Path, store_only: bool = False) -> Any:
    """Run ``fn`` with a client: an unknown block or instance (LookupError) exits 1, an invalid
    id or value (ValueError) exits 2, each as one line. ``store_only``: ``fn`` only reads Redis
    (``c.store``): no NATS connection is made."""
    try:
        return _run((_with_store if store_only else _with_client)(data_dir, fn))
    except LookupError as exc:
        err.print(f"[red]{escape(str(exc.args[0]))}[/]")
        raise typer.Exit(1)
    except ValueError as exc:  # an invalid id or value: a usage mistake
        err.print(f"[red]error:[/] {escape(_one_line(exc))}")
        raise typer.Exit(2)


NoWait = typer.Option(False, "--no-wait", help="Return once the request is published.")
Timeout = typer.Option(120.0, "--timeout", help="Give up waiting after this many seconds (exit 5).", callback=_seconds_over())


def _follow_request(make: Callable[[Client], Awaitable[Request]], wait: bool, timeout: float, data_dir: Path) -> int:
    """Publish a request and, unless --no-wait, follow the block until it succeeds (exit 0) or
    fails (exit 3, with the reason); 5 on timeout; 1 when refused before publishing."""

    async def go(c: Client) -> int:
        req = await make(c)
        what = f"{req.action} of {req.bid} requested" + (f" ({req.request_id})" if req.request_id else "")
        if not wait:
            console.print(escape(f"{what}; follow with: blocks watch {req.bid}"))
            return 0
        console.print(escape(what))
        try:
            ok, why, _ = await c.outcome(req, timeout)
        except TimeoutError:
            err.print(f"[red]no outcome after {timeout:g}s[/]; follow with: blocks watch {req.bid}")
            return 5
        if ok:
            console.print(f"[green]{req.action} done[/]: {escape(why)}")
            return 0
        err.print(f"[red]{req.action} failed[/]: {escape(why)}")
        return 3

    return int(_request(go, data_dir))


@app.command()
def scale(
    bid: str,
    to: int | None = typer.Option(None, "--to", help="Desired instance count, clamped to [minInstances, maxInstances]: "
                                  "reached with scale-ups and scale-downs (resourceAllocator actions scale, scale_down)."),
    no_wait: bool = NoWait, timeout: float = Timeout, data_dir: Path = DataDir,
) -> None:
    """Without --to: add one instance to a placed block (resourceAllocator action `scale`) and wait
    until it runs. With --to N: set the block's desired count and wait until it runs exactly that
    many (a scale-down drains the chosen instances first). Exit 0 done, 3 failed (e.g. already at
    maxInstances, a policy error), 5 timeout, 1 unknown or unplaced block, 2 a bad N.

    Example: `blocks scale blk-1234`, `blocks scale blk-1234 --to 3`
    """
    if to is not None and to < 0:  # a usage mistake: said before looking for the servers
        err.print(f"[red]error:[/] target must be a count of instances >= 0, got {to}")
        raise typer.Exit(2)
    if to is None:
        raise typer.Exit(_follow_request(lambda c: c.scale_request(bid), not no_wait, timeout, data_dir))

    async def go(c: Client) -> int:
        req = await c.scale_to(bid, to)
        clamp = f" ({req.note})" if req.note else ""
        console.print(f"scale of {bid} to {req.target}{clamp} requested ({req.request_id}); running now: {req.before}")
        if no_wait:
            console.print(f"follow with: blocks watch {bid}")
            return 0

        def progress(running: int, starting: int, removing: int) -> None:
            console.print(f"  running {running}, starting {starting}, removing {removing} (target {req.target})")

        try:
            ok, why = await c.wait_scaled(req, timeout, progress)
        except TimeoutError:
            err.print(f"[red]target {req.target} not reached after {timeout:g}s[/]; follow with: blocks watch {bid}")
            return 5
        if ok:
            console.print(f"[green]scale done[/]: {escape(why)}")
            return 0
        err.print(f"[red]scale failed[/]: {escape(why)}")
        return 3

    raise typer.Exit(int(_request(go, data_dir)))


@app.command()
def reassign(bid: str, instance_id: str, no_wait: bool = NoWait, timeout: float = Timeout, data_dir: Path = DataDir) -> None:
    """Move one instance elsewhere (resourceAllocator action `reassignment`) and wait until its
    replacement runs. Exit 0 moved, 3 failed, 5 timeout, 1 unknown block or instance.

    Example: `blocks reassign blk-1234 blk-1234-0`
    """
    raise typer.Exit(_follow_request(lambda c: c.reassign_request(bid, instance_id), not no_wait, timeout, data_dir))


@app.command()
def delete(bid: str, no_wait: bool = NoWait, timeout: float = Timeout, data_dir: Path = DataDir) -> None:
    """Delete a block: every instance is removed and its resources released, then `deleted`.
    Waits for `deleted`. Exit 0 deleted, 5 timeout, 1 unknown or already deleted.

    Example: `blocks delete blk-1234`
    """
    raise typer.Exit(_follow_request(lambda c: c.delete(bid), not no_wait, timeout, data_dir))


@app.command()
def watch(bid: str = typer.Argument("*", help="Block id, or all blocks."), data_dir: Path = DataDir) -> None:
    """Print lifecycle events live as they happen (Ctrl-C stops).

    Example: `blocks watch` or `blocks watch blk-1234`
    """

    async def go(c: Client) -> None:
        async for subject, env in c.follow(bid, from_start=False):
            console.print(f"{env.get('time', '')[11:23]} {subject.split('.')[2]:<20} {_line(subject, env)}")

    try:
        _request(go, data_dir)
    except KeyboardInterrupt:
        pass


@app.command()
def top(
    bid: str = typer.Argument(None, help="Block id: one row per instance. Without: one row per block.", callback=_block_id),
    once: bool = typer.Option(False, "--once", help="Print the table once and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print the samples once as JSON and exit."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between refreshes (at least 0.1).",
                                   callback=_seconds_over(0.1, inclusive=True)),
    data_dir: Path = DataDir,
) -> None:
    """Live per-block or per-instance in-flight, task rate, latency and errors, from the metrics
    collector's windows (docs/metrics.md; `blocks up` runs a collector). Ctrl-C stops. Exit 1
    when the collector has nothing for BID (yet).

    Example: `blocks top`, `blocks top blk-1234`, `blocks top blk-1234 --json`
    """
    import asyncio

    from rich.live import Live

    from . import top as topview

    def missing(data: dict[str, Any]) -> bool:
        return bid is not None and data.get("block") is None and not data.get("instances")

    async def go(c: Client) -> int:
        data = await topview.read(c.store, bid)
        if as_json or once:
            if as_json:
                print(json.dumps(data, indent=1, sort_keys=True))
            else:
                console.print(topview.table(data, bid))
            if missing(data):
                err.print(f"[red]no metrics for block {escape(bid or '')}[/] (unknown, not serving yet, or no collector: `blocks up` starts one)")
                return 1
            return 0
        with Live(topview.table(data, bid), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(topview.table(await topview.read(c.store, bid), bid))

    try:
        raise typer.Exit(_request(go, data_dir, store_only=True))
    except KeyboardInterrupt:
        pass


@app.command("prometheus-config")
def prometheus_config(
    static: bool = typer.Option(False, "--static", help="List the targets of this moment instead of the collector's http_sd URLs."),
    scrape_interval: str = typer.Option("15s", "--scrape-interval", help="Prometheus scrape_interval."),
    refresh_interval: str = typer.Option("30s", "--refresh-interval", help="How often Prometheus re-reads the targets (http_sd)."),
    data_dir: Path = DataDir,
) -> None:
    """Print a Prometheus scrape config (YAML) for the running system: the workers' /metrics
    (job aios-workers) and every block instance's /metrics (job aios-instances; labels block,
    instance, cluster, node). By default the targets come from the metrics collector's http_sd
    endpoints (`endpoints.json` "metrics"), so they follow the system; --static lists them as
    they are now (from the metrics store and the instance records).

    Example: `blocks prometheus-config > prometheus.yml && prometheus --config.file prometheus.yml`
    """
    from ..metrics import promconfig

    sd_url = None
    if not static:
        ep = data_dir / "endpoints.json"
        try:
            sd_url = json.loads(ep.read_text()).get("metrics") if ep.exists() else None
        except (OSError, ValueError):
            sd_url = None
        if not sd_url and ep.exists():  # (no endpoints.json at all: "No servers" says it, below)
            err.print("[yellow]no metrics collector address in endpoints.json: listing the targets of this moment (--static)[/]")

    async def go(c: Client) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        workers = promconfig.worker_targets(await c.store.metrics.targets())
        maps: dict[str, dict[str, Any]] = {}
        clusters: dict[str, str] = {}
        for b in await c.store.list_blocks(100_000):
            insts = await c.store.instances(b)
            maps[b] = {"instances": {i: {"endpoint": r.get("endpoint", ""), "node": r.get("node", ""),
                                         "state": "stopping" if r.get("status") in ("failed", "removing", "removed") else "ready"}
                                     for i, r in insts.items()}}
            clusters[b] = next((str(r.get("cluster", "")) for r in insts.values()), "")
        return workers, promconfig.instance_targets(maps, clusters)

    workers: list[dict[str, Any]] = []
    instances: list[dict[str, Any]] = []
    if not sd_url:
        workers, instances = _request(go, data_dir, store_only=True)
    sys.stdout.write(promconfig.config(sd_url, workers, instances, scrape_interval, refresh_interval))


@app.command()
def replay(
    bid: str = typer.Argument("*", help="Block id, or every block."),
    as_json: bool = typer.Option(False, "--json", help="One JSON event per line."),
    data_dir: Path = DataDir,
) -> None:
    """A block's whole story from JetStream, in order, as a timeline: sequence, time (the event's
    own, else when the stream stored it), event. `--json` lines carry `stored` too.

    Example: `blocks replay blk-1234`
    """

    async def go(c: Client) -> int:
        events = await c.timeline(bid)
        if not events:
            err.print(f"[yellow]no events for {bid}[/]")
            return 1
        if as_json:
            for subject, env, seq, stored in events:
                print(json.dumps({"seq": seq, "subject": subject, "stored": stored, "event": env}, default=str))
            return 0
        console.print(f"[bold]replay {bid}[/]: {len(events)} events")
        for subject, env, seq, stored in events:
            at = str(env.get("time") or stored)  # a bare create has no time of its own: when it was stored
            console.print(f"{seq:>7} {at[11:23]} {subject.split('.')[2]:<20} {_line(subject, env)}")
        return 0

    raise typer.Exit(_request(go, data_dir))


@app.command()
def explain(
    bid: str,
    as_json: bool = typer.Option(False, "--json", help="The explanation as one JSON document."),
    inputs: bool = typer.Option(False, "--inputs", help="Rebuild every policy call's input by replaying the stream and check it against the recorded digest."),
    data_dir: Path = DataDir,
) -> None:
    """Why the block is where it is, from the stream alone: candidates and filtered clusters, each
    cluster's dry_run score and node/GPUs (and nodes rejected by affinity), why the final cluster
    won, each instance's node and GPUs, failures with reasons, policy calls. With ``--inputs``,
    each call's input is rebuilt by replay (inputs are not stored) and checked against its digest.

    Example: `blocks explain blk-1234 --json --inputs`
    """
    from ..handlers.explain import explain as fold

    async def go(c: Client) -> int:
        events = [(s, e) for s, e, _ in await c.history(bid)]
        if not events:
            err.print(f"[yellow]no events for {bid}[/]")
            return 1
        x = fold(events)
        if inputs:
            calls = await c.decisions(bid=bid)
            checks: dict[str, int] = {}
            for d in calls:
                checks[d["input_check"]] = checks.get(d["input_check"], 0) + 1
            x["decisions"]["inputs"] = checks
            x["decisions"]["calls"] = [
                {k: d.get(k) for k in ("kind", "action", "input_digest", "input_check", "state_seq", "at", "input")} for d in calls
            ]
            if not as_json:
                console.print("policy inputs rebuilt by replay: " + ", ".join(f"{n} {k}" for k, n in sorted(checks.items())))
        if as_json:
            print(json.dumps(x, indent=2, default=str))
            return 0
        _render_explain(x)
        return 0

    raise typer.Exit(_run(_with_client(data_dir, go)))


def _adapt_line(adapt: dict[str, Any]) -> str:
    """The adapt stage's table on one line: the figure, the block median, each node's p50 and multiplier."""
    if not adapt.get("figure"):
        return "no live metrics for the block: every Adaptive entry has its base weight"
    lo, hi = adapt.get("bounds") or ["?", "?"]
    nodes = ", ".join(f"{n} {v['p50_ms']:g} ms x{v['multiplier']:g}" for n, v in sorted((adapt.get("nodes") or {}).items()))
    return f"{adapt['figure']} block median {adapt['block_median_ms']:g} ms; {nodes} (multiplier = median / node p50, in [{lo:g}, {hi:g}])"


def _render_explain(x: dict[str, Any]) -> None:
    colour = {"ready": "green", "failed": "red", "rejected": "red"}.get(x["status"], "yellow")
    console.print(f"[bold]block {escape(x['block_id'])}[/]: [{colour}]{x['status']}[/]" + (f" - {escape(x['reason'])}" if x["reason"] else ""))
    for e in x["rejected_errors"]:
        console.print(f"  [red]{escape(e['path'])}[/]: {escape(e['message'])}")
    for r in x["rounds"]:
        t = _table("cluster", "outcome", "dry_run score", "node / GPUs", "notes", title=escape(f"selection round {r['round']}: " + (r["why"] or "no cluster chosen")))
        for cid, why in sorted(r["filtered"].items()):
            t.add_row(escape(cid), "[red]filtered[/]", "", "", escape(why))
        for cid in r["candidates"]:
            d = r["dry_run"].get(cid)
            outcome = "[green]chosen[/]" if cid == r["chosen"] else "candidate"
            if d is None:
                t.add_row(escape(cid), outcome, "0 (no answer)" if cid in r["missing"] else "-", "", "")
                continue
            notes = d["error"]
            rejected = d["rejected_nodes"]
            if rejected:
                notes += (" " if notes else "") + f"{len(rejected)} node(s) rejected (affinity, capacity), e.g. " + "; ".join(
                    f"{n}: {w}" for n, w in list(rejected.items())[:3]
                )
            t.add_row(escape(cid), outcome, *_plain(f"{d['score']:g}", f"{d['node']} {','.join(d['gpus'])}".strip(), notes))
        console.print(t)
    if x["instances"]:
        t = _table("instance", "node", "GPUs", "placed by", "status", "health", title="instances")
        for iid, i in sorted(x["instances"].items()):
            t.add_row(*_plain(iid, i["node"], ",".join(i["gpus"]), i.get("action", ""), i.get("status", ""), i.get("health", "")))
        console.print(t)
        for iid, i in sorted(x["instances"].items()):
            for v in i.get("verdicts", []):
                console.print(f"[yellow]{escape(iid)} {escape(v['verdict'])}[/] " + escape(f"({v['policy']}): {v['reason']}"))
    if x.get("adapt"):
        console.print("adaptive affinity (adapt stage): " + escape(_adapt_line(x["adapt"])))
    for iid, i in sorted(x["instances"].items()):
        for a in i.get("adaptive") or []:
            console.print(escape(f"  {iid} on {i['node']}: entry {a['entry']} base weight {a['base']:g} -> adapted {a['weight']:g} ({a['why']})"))
    for f in x["failures"]:
        console.print(f"[red]{escape(f['step'])} failed[/]: {escape(f['reason'])}")
    auto = x.get("autoscaler") or {}
    if auto.get("decisions"):
        t = _table("time", "count", "policy proposal", "policy's reason", "framework rules", title="autoscaler decisions")
        for a in auto["decisions"]:
            arrow = "[green]grew[/]" if (a["to"] or 0) > (a["from"] or 0) else "[yellow]shrank[/]"
            t.add_row(str(a["time"])[11:19], f"{a['from']} -> {a['to']} {arrow}", *_plain(f"{a['proposal']:g}", a["reason"], "; ".join(a["rules"])))
        console.print(t)
    for f in auto.get("failures") or []:
        quiet = f" ({f['quiet']} more failed ticks before, not stored)" if f.get("quiet") else ""
        console.print("[red]autoscaler tick failed[/] " + escape(f"{str(f['time'])[11:19]}: {f['reason']} - count stays {f['count']}{quiet}"))
    others = [t for t in x.get("targets") or [] if t["source"] != "autoscaler"]
    for tg in others:
        console.print(escape(f"instance target {tg['target']} asked by {tg['source']} {str(tg['time'])[11:19]}: {tg['reason']}"))
    d = x["decisions"]
    if d["count"]:
        console.print(f"{d['count']} policy calls, {d['errors']} failed, {d['total_us'] / 1000:.2f} ms in policies:")
        for key, per in sorted(d["by_policy"].items()):
            console.print(escape(f"  {key}: {per['calls']} calls {per['actions']} {per['us'] / 1000:.2f} ms"))


# -- policies ---------------------------------------------------------------------------------
@policy_app.command("run")
def policy_run(
    file_or_uri: str = typer.Argument(..., help="A .py or .star file, builtin:NAME or module:Class."),
    input_file: Path = typer.Option(..., "--input", "-i", help='JSON: {"action": ..., ...} as the seed defines; for --kind lxd, {"request", "candidate_members", ...}.'),
    kind: str = typer.Option("resourceAllocator", help="clusterAllocator | resourceAllocator | lxd (an LXD instance_placement scriptlet)"),
    parameters: str = typer.Option("{}", help="JSON parameters."),
    settings: str = typer.Option("{}", help="JSON settings."),
) -> None:
    """Run one policy once with the seed's interface and print its result as JSON (no servers).
    With `--kind lxd`, run an LXD placement scriptlet on LXD's own arguments (optionally with
    `member_state` / `member_resources` / `instance_resources` for the helpers) and print the
    chosen target; a rejection exits 1 with the scriptlet's message.

    Example: `blocks policy run my_policy.py --kind clusterAllocator --input selection.json`,
    `blocks policy run placement.star --kind lxd --input lxd_args.json`
    """
    from ..policies.runtime import PolicyRuntime
    from ..schemas.errors import PolicyFailed

    input_data = _load(input_file)
    if kind == "lxd":
        from ..policies.starlark_runtime import StarlarkError, run_lxd

        try:
            out = run_lxd(Path(file_or_uri).read_text(), Path(file_or_uri).stem, input_data)
        except (OSError, StarlarkError) as exc:
            err.print(f"[red]{exc}[/]")
            raise typer.Exit(1)
        for level, text in out["logs"]:
            err.print(f"[dim][{level}][/] {text}")
        print(json.dumps({"target": out["target"]}))
        return
    rule = {"name": kind, "policyRuleURI": file_or_uri, "parameters": _json_option(parameters, "--parameters"),
            "settings": _json_option(settings, "--settings")}
    runtime = PolicyRuntime(allow_files=True)
    try:
        result = _run(runtime.invoke(rule, f"cli.{kind}", input_data, {}))
    except PolicyFailed as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(1)
    print(json.dumps(result, indent=2, default=str))


@policy_app.command("add")
def policy_add(name: str, file: Path, data_dir: Path = DataDir) -> None:
    """Store a policy (Python `.py`, trusted; Starlark `.star`, sandboxed) in the registry as a new
    version and tell workers; blocks use it as `registry:NAME` (their IR pins the version).

    Example: `blocks policy add my-packer my_packer.py`, `blocks policy add lxd-mem most_free.star`
    """
    from ..policies.runtime import compile_source, language_of

    source = file.read_text()
    language = language_of(str(file))
    try:
        compile_source(source, language, str(file))
    except Exception as exc:
        err.print(f"[red]{file} does not load: {type(exc).__name__}: {exc}[/]")
        raise typer.Exit(1)

    async def go(c: Client) -> int:
        return await c.policy_put(name, source, language)  # the policy.updated event tells workers

    version = _request(go, data_dir)
    console.print(f"policy [bold]{name}[/] version {version} stored; use policyRuleURI: registry:{name}")


@policy_app.command("test")
def policy_test(
    name: str = typer.Argument(..., help="Policy whose recorded decisions to re-run: a registry name, a policy rule name (resourceAllocator) or a policyRuleURI."),
    file: Path = typer.Argument(..., help="Candidate version (.py)."),
    since: str = typer.Option(None, help="Only decisions newer than this: seconds, or 30m / 2h / 1d."),
    blocks_: int = typer.Option(0, "--blocks", help="Only the N most recent blocks (0 = all)."),
    as_json: bool = typer.Option(False, "--json"),
    data_dir: Path = DataDir,
) -> None:
    """Re-run recorded decisions of past blocks against a candidate policy version, offline, and
    print what would have changed (different cluster/node, newly failing, newly feasible).

    Example: `blocks policy test my-packer my_packer_v2.py --since 2h --blocks 50`
    """
    from ..handlers.policy_test import compare
    from ..policies.runtime import PolicyRuntime

    cutoff = time.time() - _seconds(since, "--since") if since else None
    runtime = PolicyRuntime(allow_files=True)

    async def go(c: Client) -> dict[str, Any]:
        recorded = [
            d for d in await c.decisions(cutoff)
            if name in (d.get("policy"), d.get("uri"), d.get("kind"), d.get("uri", "").removeprefix("registry:"))
        ]
        if blocks_:
            keep = list(dict.fromkeys(d["block_id"] for d in reversed(recorded)))[:blocks_]
            recorded = [d for d in recorded if d["block_id"] in set(keep)]

        async def run(input_data: dict[str, Any]) -> Any:
            rule = {"name": name, "policyRuleURI": str(file), "parameters": {}, "settings": {}}
            return await runtime.invoke(rule, f"policy-test.{name}", input_data, {})

        return await compare(recorded, run)

    report = _run(_with_client(data_dir, go))
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    c = report["counts"]
    console.print(
        f"{report['total']} recorded decisions of [bold]{name}[/]: {c['same']} same, [yellow]{c['changed']} changed[/], "
        f"[red]{c['newly_failing']} newly failing[/], [green]{c['newly_feasible']} newly feasible[/], {c['skipped']} without input"
    )
    if report["changes"]:
        t = _table("block", "action", "recorded", "candidate", "verdict")
        for row in report["changes"]:
            t.add_row(*_plain(row["block_id"], row["action"], row["before"], row["after"], row["verdict"]))
        console.print(t)


@policy_app.command("input")
def policy_input(
    bid: str = typer.Argument(..., help="Block whose recorded policy call to dump."),
    step: str = typer.Option("allocation", "--step", help="The call's action: selection, dry_run, post_dry_run, allocation, scale, scale_down, reassignment."),
    index: int = typer.Option(-1, "--index", help="Which call of that step, oldest first (0, 1, ...; -1 = the last)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the input here instead of stdout."),
    data_dir: Path = DataDir,
) -> None:
    """Dump the exact input a block's policy got at one step (from its recorded decision), ready
    for `blocks policy run FILE --input`: replay a real placement against your own policy offline.

    Example: `blocks policy input BID --step allocation -o input.json`,
    then `blocks policy run examples/first_fit.py --input input.json`
    """

    async def go(c: Client) -> list[dict[str, Any]]:
        return await c.decisions(bid=bid)

    recorded = _run(_with_client(data_dir, go))
    calls = [d for d in recorded if d.get("action") == step]
    if not calls:
        steps = sorted({str(d.get("action")) for d in recorded})
        where = f"its recorded steps: {', '.join(steps)}" if steps else "no policy call is recorded for it"
        err.print(f"[red]block {bid} has no recorded {step!r} policy call[/] ({where})")
        raise typer.Exit(1)
    if not -len(calls) <= index < len(calls):
        err.print(f"[red]--index {index} out of range[/]: block {bid} has {len(calls)} recorded {step!r} call(s)")
        raise typer.Exit(2)
    call = calls[index]
    if call.get("input") is None:
        err.print(f"[red]the input of that call could not be rebuilt by replay[/] ({call.get('input_check')}, digest {call.get('input_digest')})")
        raise typer.Exit(1)
    text = json.dumps(call["input"], indent=2, default=str)
    if output is None:
        print(text)
        return
    output.write_text(text + "\n")
    err.print(f"wrote {output}: the {step} input of {call.get('kind')} ({call.get('uri')}), call {index if index >= 0 else len(calls) + index} of {len(calls)}")


@policy_app.command("list")
def policy_list(data_dir: Path = DataDir) -> None:
    """List registry policies. Example: `blocks policy list`"""

    async def go(c: Client) -> None:
        t = _table("name", "version", "language")
        for name in await c.store.policy_names():
            rec = await c.store.policy_get(name) or {}
            t.add_row(*_plain(name, rec.get("version", ""), rec.get("language", "")))
        console.print(t)

    _run(_with_store(data_dir, go))


@policy_app.command("show")
def policy_show(name: str, version: int = typer.Option(None), data_dir: Path = DataDir) -> None:
    """Print a registry policy's source. Example: `blocks policy show my-packer --version 2`"""
    rec = _run(_with_store(data_dir, lambda c: c.store.policy_get(name, version)))
    if rec is None:
        err.print(f"[red]no policy {name}[/]")
        raise typer.Exit(1)
    console.print(escape(f"# {name} v{rec['version']} ({rec.get('language')})"))
    print(rec["source"])


def subjects_(
    markdown: bool = typer.Option(False, "--markdown", help="Print docs/subjects.md's table (generated from the catalog)."),
) -> None:
    """Every NATS subject the system uses: who publishes it, whether the stream stores it, which
    durable consumers take it. Example: `blocks subjects`, `blocks subjects --markdown`"""
    from ..bus import catalog_doc

    if markdown:
        print(catalog_doc.catalog_markdown())
        return
    t = _table("subject", "published by", "stored", "durable consumers", "message id", "meaning")
    for row in catalog_doc.catalog_rows():
        t.add_row(*_plain(*row))
    console.print(t)


app.command("subjects")(subjects_)


def asyncapi_(
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the document to this file instead of stdout."),
    yaml_: bool = typer.Option(False, "--yaml", help="YAML instead of JSON."),
) -> None:
    """The AsyncAPI 3.0 document of every event (channels, messages with JSON Schemas of the body
    and the NATS headers and an example each, which role sends what, which consumer receives
    what), generated from the event catalog.
    Example: `blocks asyncapi -o aios.asyncapi.json`"""
    import yaml

    from ..bus import asyncapi

    doc = asyncapi.document()
    if yaml_:
        text = yaml.safe_dump(doc, sort_keys=False)
    else:
        text = json.dumps(doc, indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        console.print(f"wrote {out} ({len(doc['channels'])} channels, {len(doc['operations'])} operations)")


app.command("asyncapi")(asyncapi_)


def settings_(
    markdown: bool = typer.Option(False, "--markdown", help="Print docs/settings.md's table."),
) -> None:
    """Every AIOS_* setting: its value in this environment, its default and what it does.
    Example: `blocks settings`, `AIOS_NODE_TIMEOUT_S=5 blocks settings`"""
    from .. import settings as st

    if markdown:
        print(st.markdown())
        return
    current = st.load()
    t = _table("variable", "value", "default", "meaning")
    for name, f in st.Settings.model_fields.items():
        value = getattr(current, name)
        shown = "(set)" if name == "event_key" and value else str(value)
        t.add_row(*_plain(f"AIOS_{name.upper()}", shown, f.default, f.description or ""))
    console.print(t)


app.command("settings")(settings_)


# -- recovery and invariants (docs/reliability.md) ----------------------------------------------
state_app = typer.Typer(help="Inspect the Redis state (digest, diff against the stream).", no_args_is_help=True)
app.add_typer(state_app, name="state")


@app.command()
def recover(
    force: bool = typer.Option(False, "--force", help="Replace the project's aios:* keys if Redis is not empty."),
    data_dir: Path = DataDir,
) -> None:
    """Rebuild the Redis state from the JetStream stream `AIOS` (components, clusters, nodes, blocks,
    instances, reservations and usage, affinity index, policy registry). Workers pause while the
    state epoch is absent and resume when it is back. Only keys this project owns are touched.

    Example: `blocks recover` (empty Redis) or `blocks recover --force`
    """
    from ..recovery.rebuild import RecoverRefused
    from ..recovery.rebuild import recover as rebuild

    async def go(c: Client) -> int:
        try:
            rep = await rebuild(c.bus, c.store, force=force)
        except RecoverRefused as exc:
            err.print(f"[red]{exc}[/]")
            return 1
        console.print(
            f"[green]recovered[/] {rep.keys} keys from {rep.events} events "
            f"(read+fold {rep.seconds_read:.2f}s, write {rep.seconds_write:.2f}s, {rep.dropped} old keys dropped)"
        )
        console.print(f"digest {rep.digest}")
        for a in rep.anomalies[:20]:
            err.print(f"[yellow]anomaly[/] {escape(a)}")
        return 0

    raise typer.Exit(_run(_with_client(data_dir, go)))


@app.command()
def check(
    settled: bool = typer.Option(True, "--settled/--live", help="--live: blocks in flight and a digest mismatch are warnings."),
    stuck_after: float = typer.Option(
        None, "--stuck-after", envvar="AIOS_STUCK_AFTER_S", callback=_seconds_over(1, inclusive=True),
        help="A block in flight with no event for this many seconds is stuck (a violation, --live too). [default: 600]"),
    as_json: bool = typer.Option(False, "--json"),
    data_dir: Path = DataDir,
) -> None:
    """Check the invariants: every block ready/failed/rejected/deleted with a reason, no GPU over
    capacity and usage equal to the reservations, no instance twice, Redis == state rebuilt from
    the stream, no block stuck in flight. Exit 0 when they hold, 1 when not.

    Example: `blocks check --live`, `blocks check --live --stuck-after 120`
    """
    from ..recovery.invariants import DEFAULT_STUCK_AFTER_S
    from ..recovery.invariants import check as run_check

    limit = stuck_after or DEFAULT_STUCK_AFTER_S
    rep = _run(_with_client(data_dir, lambda c: run_check(c.bus, c.store, settled=settled, stuck_after=limit)))
    if as_json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        for v in rep.violations:
            console.print(f"[red]violation[/] {escape(v)}")
        for w in rep.warnings:
            console.print(f"[yellow]warning[/] {escape(w)}")
        for d in rep.diff:
            console.print(f"  [dim]{escape(d)}[/]")
        console.print(f"counts {rep.counts}")
        console.print(f"redis digest  {rep.redis_digest}\nstream digest {rep.stream_digest}")
        console.print("[green]invariants hold[/]" if rep.ok else f"[red]{len(rep.violations)} violation(s)[/]")
    raise typer.Exit(0 if rep.ok else 1)


@state_app.command("digest")
def state_digest(
    stream: bool = typer.Option(False, "--stream", help="Also the digest of the state rebuilt from the stream."),
    data_dir: Path = DataDir,
) -> None:
    """Canonical digest of the project's Redis state (volatile fields left out; see docs/reliability.md).

    Example: `blocks state digest --stream`
    """
    from ..recovery import image as im
    from ..recovery.rebuild import fold_stream, read_image

    async def go(c: Client) -> tuple[str, str]:
        redis_digest = im.digest(await read_image(c.store.r))
        stream_digest = im.digest((await fold_stream(c.bus)).image(include_gathers=False)) if stream else ""
        return redis_digest, stream_digest

    redis_digest, stream_digest = _run(_with_client(data_dir, go))
    print(f"redis  {redis_digest}")
    if stream:
        print(f"stream {stream_digest}")
        raise typer.Exit(0 if redis_digest == stream_digest else 1)


# -- virtual clusters (seed 003): their own module ------------------------------------------------
from . import nodes as _nodes  # noqa: E402  (they use the helpers above)
from . import vcluster as _vcluster  # noqa: E402

_vcluster.register(app, DataDir)
_nodes.register(node_app, cluster_app, DataDir)
from . import trace as _trace  # noqa: E402

_trace.register(app, cluster_app, DataDir)
