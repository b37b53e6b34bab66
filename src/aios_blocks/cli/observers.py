"""``blocks observer add|list|remove``: a NATS user per observer (dashboard, person, auditor) on
the embedded server of a running ``blocks up`` (docs/security.md "Observers: a user each";
``runtime.observers``). Each observer touches only the consumers named after its user, so none
can delete, read or take over another's; each change rewrites the server's users and reloads them."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import DataDir, console, embedded
from .render import _print_json, _table

app = typer.Typer(help="Observers: a NATS user each, reading every event, touching only its own consumers "
                       "(docs/security.md).", no_args_is_help=True)


@app.command("add")
def observer_add(
    name: str = typer.Argument(..., help="The observer's name (a block id's characters): it logs in as observer-NAME."),
    as_json: bool = typer.Option(False, "--json", help="Print {observer, user, new, credentials}."),
    data_dir: Path = DataDir,
) -> None:
    """Add an observer (one per dashboard or client): its own NATS user and credentials file (0600:
    nats_url, inbox_prefix, its consumer names, the read-only redis_url). Again: the same user.

    Example: `blocks observer add grafana --json`; then `AIOS_NATS_URL=<nats_url> AIOS_REDIS_URL=<redis_url> blocks watch`
    """
    from ..runtime import observers

    new, path = observers.add_observer(embedded(data_dir, "observers"), name)
    user = observers.observer_user(name)
    if as_json:
        _print_json({"observer": name, "user": user, "new": new, "credentials": str(path)})
        return
    console.print(f"observer [bold]{user}[/]{'' if new else ' (existed)'}: credentials in {path}")


@app.command("list")
def observer_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """The observers added (the data dir's own `observer` is not listed).

    Example: `blocks observer list`
    """
    from ..runtime import observers

    rows = observers.observers(embedded(data_dir, "observers", running=False))
    if as_json:
        _print_json(rows)
        return
    table = _table("observer", "user", "credentials")
    for r in rows:
        table.add_row(r["observer"], r["user"], r["credentials"])
    console.print(table)


@app.command("remove")
def observer_remove(name: str = typer.Argument(...), data_dir: Path = DataDir) -> None:
    """Remove an observer's user: its connections are closed and its credentials file deleted.

    Example: `blocks observer remove grafana`
    """
    from ..runtime import observers

    if not observers.remove_observer(embedded(data_dir, "observers"), name):
        raise LookupError(f"no observer {name!r}")
    console.print(f"observer [bold]{name}[/] removed")
