"""``blocks observer add|list|remove``: a NATS user per observer (dashboard, person, auditor) on
the embedded server of a running ``blocks up`` (docs/security.md "Observers: a user each";
``runtime.observers``). Each observer touches only the consumers named after its user, so none
can delete, read or take over another's; each change rewrites the server's users and reloads them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .common import DataDir, _request, console, embedded
from .render import _print_json, _table

if TYPE_CHECKING:
    from .client import Client

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
    """Remove an observer's user: its connections are closed, its consumers deleted (on `AIOS` and
    `AIOS_OBSERVE`: an observer added again by the same name starts from none) and its credentials
    file deleted.

    Example: `blocks observer remove grafana`
    """
    from ..runtime import observers

    d = embedded(data_dir, "observers")
    if not observers.remove_observer(d, name):
        raise LookupError(f"no observer {name!r}")
    dropped = _request(lambda c: _drop_consumers(c, observers.observer_user(name)), d)
    console.print(f"observer [bold]{name}[/] removed" + (f" ({dropped} consumer{'s' * (dropped != 1)} deleted)" if dropped else ""))


async def _drop_consumers(c: Client, user: str) -> int:
    """Delete the consumers named after ``user`` (admin's right): none is left for a later user of
    that name to take over with its position."""
    from ..bus import subjects
    from ..schemas.roles import observer_consumers

    n = 0
    for stream in (subjects.STREAM, subjects.STREAM_OBSERVE):
        for durable in observer_consumers(user):
            n += await c.bus.delete_consumer(stream, durable)
    return n
