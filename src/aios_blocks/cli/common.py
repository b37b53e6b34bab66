"""What every ``blocks`` command shares: the consoles, the ``--data-dir`` option and how it is
found, the servers' URLs, running a command's coroutine with a client, and reading the user's
input (a mistake is one line and exit 2, never a traceback).

Start-up: only typer and rich at the top; every other module is imported by the function that
needs it (tests/unit/test_cli_imports.py holds the CLI to that)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ..runtime.locate import DEFAULT_DATA_DIR, find_data_dir
from ..urls import mask

if TYPE_CHECKING:
    from ..schemas.records import JSONObject
    from .client import Client, Request

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


class _Stderr:
    """``sys.stderr`` as it is when a line is written: a test's CliRunner swaps it for each command
    and closes it afterwards, and a logger bound to that stream would fail every later line."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _quiet_library_logs() -> None:
    """CLI output is for people: library logs go to stderr, warnings and up only. Called once the
    library is imported (structlog comes with it: a command that never loads it skips its import)."""
    structlog = sys.modules.get("structlog")
    if structlog is None:
        return
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        wrapper_class=structlog.make_filtering_bound_logger(30),
    )


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR on its write end):
    a BrokenPipeError from there, not from a server's socket."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real fd (a test's runner), no poll
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _run(coro: Awaitable[T], quiet: bool = True) -> T:
    """Run a command's coroutine; a server it cannot reach is a one-line error (exit 2), not a
    traceback nor a hang. ``quiet``: library logs at warning and up only (a command's output is for
    people); ``False`` for the daemons (`blocks worker`, `blocks agent`) whose own JSON log at
    ``AIOS_LOG_LEVEL`` ``configure_logging`` set up (their info lines were dropped)."""
    import asyncio

    if quiet:
        _quiet_library_logs()
    try:
        return asyncio.run(coro)  # type: ignore[arg-type]
    except ConnectionError as exc:  # Unreachable (NATS), refused or reset connections
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            # `blocks replay --json | head`: the reader has what it wanted; not a server's fault
            _silence_stdout()
            raise typer.Exit(0) from None
        err.print(f"[red]Cannot reach the servers[/]: {escape(mask(str(exc)))}")
        raise typer.Exit(2) from None
    except Exception as exc:
        # JetStream answering 503 (a stream or meta leader election under way, a server away): the
        # servers cannot say now, which is not a refusal nor a failed check (exit 1)
        from nats.js.errors import ServiceUnavailableError
        from redis.exceptions import ResponseError

        if isinstance(exc, ResponseError):  # a key of the wrong kind (damaged state): one line, not a traceback
            err.print(f"[red]Redis refused a command[/]: {escape(mask(str(exc)))} (`blocks check` says what is damaged; "
                      "`blocks recover --force` rebuilds Redis from the stream)")
            raise typer.Exit(2) from None
        if not isinstance(exc, ServiceUnavailableError):
            raise
        err.print(f"[red]Cannot reach the servers[/]: JetStream is unavailable for now ({escape(exc.description or '')}): "
                  "try again")
        raise typer.Exit(2) from None


def _why(exc: BaseException) -> str:
    """A credentials file's problem in words (``CredentialsUnreadable`` says which file and what is
    wrong); another error by its kind only, as before (its text might quote the file)."""
    from ..runtime.locate import CredentialsUnreadable

    return escape(str(exc)) if isinstance(exc, CredentialsUnreadable) else type(exc).__name__


def _urls(data_dir: Path, role: str | None = None) -> tuple[str, str]:
    """URLs from the environment, else a running ``blocks up``'s with ``role``'s credentials
    (default ``AIOS_ROLE``, else the admin)."""
    from ..runtime import lifetime
    from ..runtime.locate import resolve_urls

    try:
        urls = resolve_urls(data_dir, role)
    except (OSError, KeyError) as exc:
        err.print(f"[red]Cannot read the credentials of the servers in {escape(str(data_dir))}[/]: {_why(exc)}")
        raise typer.Exit(2)
    if urls is None:
        _no_servers(data_dir)
    if not (os.environ.get("AIOS_NATS_URL") and os.environ.get("AIOS_REDIS_URL")) and not lifetime.in_use(data_dir):
        _left_over(data_dir)
    return urls


def _no_servers(data_dir: Path, what: str = "no endpoints.json") -> NoReturn:
    looked = "; ".join(_LOOKED) or str(data_dir)
    err.print(
        f"[red]No servers.[/] No running `blocks up` found in {escape(looked)} ({what}). "
        "Start one with [bold]blocks up[/], pass [bold]--data-dir[/] or set AIOS_DATA_DIR, "
        "or set AIOS_NATS_URL and AIOS_REDIS_URL."
    )
    raise typer.Exit(2)


def _left_over(data_dir: Path) -> NoReturn:
    err.print(f"[red]No servers.[/] {escape(str(data_dir))}/endpoints.json is left from a `blocks up` that is no "
              "longer running (nothing holds its lock): start it again with [bold]blocks up[/].")
    raise typer.Exit(2)


def embedded(data_dir: Path, what: str, running: bool = True) -> Path:
    """The data dir of the ``blocks up`` whose NATS users ``blocks tenant`` / ``blocks observer``
    change (``running``: it must run, with credentials on; else its secrets file must exist, for the
    lists): otherwise one line and exit 2, as every command without servers, not a traceback."""
    from ..runtime import lifetime
    from ..runtime.auth import read_endpoints

    d = Path(data_dir).resolve()
    if not running:
        if not (d / "auth" / "secrets.json").exists():
            _no_servers(data_dir, "no auth/secrets.json")
        return d
    try:
        ep = read_endpoints(d)
    except (ValueError, KeyError, TypeError):  # a file that is not what `blocks up` writes: say what is wrong
        from ..runtime.locate import endpoints_problem

        why = endpoints_problem(d)
        err.print(f"[red]Cannot read the credentials of the servers in {escape(str(data_dir))}[/]: {escape(why)}")
        raise typer.Exit(2) from None
    if ep is None:
        _no_servers(data_dir)
    if not lifetime.in_use(d):
        _left_over(data_dir)
    if not ep.auth:
        err.print(f"[red]error:[/] {what} need servers that require credentials: these run with AIOS_AUTH=0")
        raise typer.Exit(2)
    return d


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


def _load(path: Path) -> JSONObject:
    doc, problem = _read_object(path)
    if problem:
        err.print(f"[red]{escape(problem)}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    return doc


def _read_object(path: Path) -> tuple[JSONObject, str]:
    """``path``'s JSON (``.json``) or YAML object and "", or {} and why not, in one line (for a
    command that lists every problem of its arguments before it stops)."""
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        return {}, f"cannot read {path}: {exc}"
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc)
        return {}, f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {where + ' '.join(str(what).split())}"
    if not isinstance(doc, dict):
        return {}, f"{path} must hold an object"
    return doc, ""


def _labels(values: list[str], option: str = "--label") -> dict[str, str]:
    """``["k=v", ...]`` -> dict; anything else is a usage error naming the option."""
    out = {}
    for kv in values:
        key, eq, value = kv.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {kv!r}", param_hint=option)
        out[key.strip()] = value
    return out


def _json_option(text: str, option: str) -> JSONObject:
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
