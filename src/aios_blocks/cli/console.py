"""``blocks console``: the web console (docs/console.md) against any running system."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from .common import DataDir, _quiet_library_logs, _urls, console, err


def console_(
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Port to serve on (0: a free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (the console has no TLS: keep it local)."),
    data_dir: Path = DataDir,
) -> None:
    """Serve the web console of a running system in the foreground (Ctrl-C stops): the servers of
    `blocks up` in the data dir (or AIOS_NATS_URL / AIOS_REDIS_URL), read with the observer role's
    rights; scale and delete with the admin token it prints (stored 0600 in the data dir).

    Example: `blocks console --port 8080`
    """
    from ..console.__main__ import run

    _quiet_library_logs()
    # found as every command finds the system, and refused as they are (one line, exit 2): none
    # anywhere, an endpoints.json left by a `blocks up` that died (it tried to connect for 10 s),
    # credentials it cannot read (it printed "[Errno 2] ... secrets.json")
    _urls(data_dir, "observer")
    try:
        run(data_dir, host, port, say=lambda line: console.print(escape(line)))
    except KeyboardInterrupt:
        pass
    except LookupError as exc:
        err.print(f"[red]No servers.[/] {escape(str(exc))}")
        raise typer.Exit(2)
