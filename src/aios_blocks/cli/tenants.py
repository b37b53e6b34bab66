"""``blocks tenant add|list|remove`` and ``blocks tenant user add|remove``: tenants as NATS
accounts on the embedded server of a running ``blocks up`` (docs/security.md "Tenants"). Each
change rewrites the server's accounts and reloads them (``runtime.auth``); running clients of
other tenants and the workers stay connected. ``blocks tenant history`` is the tenant's side: its
block's events, asked with its credentials file (as ``blocks explain|watch -c CREDS``,
``tenant_connection``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.markup import escape

from .common import DataDir, _request, _run, console, embedded, err
from .render import _line, _print_json, _table, print_rejection

if TYPE_CHECKING:
    from ..projections.base import EventDoc
    from ..schemas.records import JSONObject
    from .client import Client

#: ``-c CREDS``: observe as a tenant (``blocks tenant history``, ``blocks explain``, ``blocks watch``)
Credentials = typer.Option(None, "--credentials", "-c", exists=True, dir_okay=False,
                           help="As a tenant: its user's credentials file (`blocks tenant add T --json`: credentials); "
                                "only its own blocks, through the gateway's tenant desk (docs/security.md).")


def read_credentials(text: str, path: Path) -> dict[str, Any]:
    """A tenant user's credentials file (``url``, ``user``, ``password``, optional ``ca``), else
    ``ValueError`` naming the file and every field it lacks (a file without ``url`` said only
    ``url``, exit 1)."""
    import json

    try:
        creds = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is no tenant credentials file (`blocks tenant add T --json`): not JSON ({exc})") from None
    if not isinstance(creds, dict):
        raise ValueError(f"{path} is no tenant credentials file (`blocks tenant add T --json`): not a JSON object")
    missing = [k for k in ("url", "user", "password") if not isinstance(creds.get(k), str) or not creds[k]]
    if missing:
        raise ValueError(f"{path} is no tenant credentials file (`blocks tenant add T --json`): "
                         + ", ".join(f"no {k!r}" for k in missing))
    return creds


@contextlib.asynccontextmanager
async def tenant_connection(credentials: Path) -> AsyncIterator[Any]:
    """A NATS connection as the tenant user of ``credentials`` (its file: url, user, password, ca),
    in nats-py's default configuration (its own account's ``_INBOX``)."""
    import asyncio

    from ..bus.connection import connect
    from ..runtime.locate import with_userinfo

    creds = read_credentials(await asyncio.to_thread(Path(credentials).read_text), credentials)
    nc = await connect(with_userinfo(creds["url"], creds["user"], creds["password"]), name="blocks-tenant",
                       ca=creds.get("ca"), first_wait_s=10)
    try:
        yield nc
    finally:
        await nc.close()

tenant_app = typer.Typer(help="Tenants: a NATS account each, with its own users and limits (docs/security.md).",
                         no_args_is_help=True)
user_app = typer.Typer(help="A tenant's users: one per client, each with its credentials file and account.", no_args_is_help=True)
tenant_app.add_typer(user_app, name="user")


def _say(tenant: str, user: str, new: bool, path: Path, as_json: bool) -> None:
    from ..runtime import tenants as tn

    if as_json:
        _print_json({"tenant": tenant, "account": tn.account(tenant, user), "user": tn.user_name(tenant, user), "new": new,
                     "credentials": str(path)})
        return
    console.print(f"tenant [bold]{tenant}[/] user [bold]{tn.user_name(tenant, user)}[/]"
                  f"{'' if new else ' (existed)'}: credentials in {path}")


def _store_limit(tenant: str, data_dir: Path, remove: bool = False) -> None:
    """The tenant's pending-create limit where the parser reads it (Redis, ``state.tenants``)."""
    from ..runtime import auth
    from ..runtime import tenants as tn
    from ..state.tenants import TenantStore

    s = auth.Secrets.load(Path(data_dir).resolve(), create=False)
    limits = tn.Tenant.from_dict(tenant, s.tenants.get(tenant, {})).limits

    async def go(c: Client) -> None:
        store = TenantStore(c.store.r)
        await (store.forget(tenant) if remove else store.set_limit(tenant, limits.pending_creates))

    _request(go, data_dir, store_only=True)


@tenant_app.command("add")
def tenant_add(
    tenant: str = typer.Argument(..., help="The tenant's name (a block id's characters): its account is tenant-NAME."),
    connections: int = typer.Option(None, "--max-connections", min=1,
                                    help="Client connections at once, all its users together (default 64)."),
    pending: int = typer.Option(None, "--max-pending-creates", min=1,
                                help="Its creates not yet placed, failed or deleted (default 100): more are rejected."),
    stream_bytes: int = typer.Option(None, "--max-stream-bytes", min=0,
                                     help="Bytes its users' JetStream streams may hold on disk, together (default 64 MiB)."),
    memory_bytes: int = typer.Option(None, "--max-memory-bytes", min=0,
                                     help="Bytes its users' memory streams may hold, together (default 8 MiB)."),
    streams: int = typer.Option(None, "--max-streams", min=1, help="JetStream streams, all its users together, at least 1 per user (default 16)."),
    consumers: int = typer.Option(None, "--max-consumers", min=1,
                                  help="JetStream consumers, all its users together (default 64)."),
    as_json: bool = typer.Option(False, "--json", help="Print {tenant, account, user, new, credentials}."),
    data_dir: Path = DataDir,
) -> None:
    """Add a tenant (a NATS account of its own) and its first user, `NAME.main`; print where its
    credentials file is (0600: url, user, password). Again with limits: change them. The limits are
    the tenant's: split across its users' accounts (`blocks tenant get NAME` shows each share);
    one that cannot give each user at least one is refused. A new name that differs from a
    tenant's only in case (`Acme` beside `acme`) is refused (exit 2): it is taken for that one.

    Example: `blocks tenant add team-a --json`, `blocks tenant add team-a --max-connections 8`
    """
    from ..runtime import auth
    from ..runtime import tenants as tn

    data_dir = embedded(data_dir, "tenants")
    given = {"connections": connections, "pending_creates": pending, "stream_bytes": stream_bytes,
             "memory_bytes": memory_bytes, "streams": streams, "consumers": consumers}
    limits = None
    if any(v is not None for v in given.values()):
        s = auth.Secrets.load(Path(data_dir).resolve(), create=False)
        limits = tn.Tenant.from_dict(tenant, s.tenants.get(tenant, {})).limits
        for name, value in given.items():
            if value is not None:
                setattr(limits, name, value)
    new, path = auth.add_tenant(data_dir, tenant, limits)
    _store_limit(tenant, data_dir)
    _say(tenant, tn.FIRST_USER, new, path, as_json)


def _limit(row: dict[str, Any], name: str) -> str:
    """A limit as the tenant's total and its accounts' shares: ``8 (3+3+2)``."""
    parts = [str(s[name]) for s in row["shares"].values()]
    return str(row["limits"][name]) + (f" ({'+'.join(parts)})" if len(parts) > 1 else "")


@tenant_app.command("list")
def tenant_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """The tenants, their users and limits: the tenant's, and (in brackets) each user account's share.

    Example: `blocks tenant list`
    """
    from ..runtime import auth

    rows = auth.tenants(embedded(data_dir, "tenants", running=False))
    if as_json:
        _print_json(rows)
        return
    table = _table("tenant", "account", "users", "connections", "pending creates", "stream bytes")
    for r in rows:
        table.add_row(r["tenant"], r["account"], ", ".join(r["users"]), _limit(r, "connections"),
                      str(r["limits"]["pending_creates"]), _limit(r, "stream_bytes"))
    console.print(table)


@tenant_app.command("get")
def tenant_get(tenant: str = typer.Argument(...), as_json: bool = typer.Option(False, "--json"),
               data_dir: Path = DataDir) -> None:
    """One tenant: its limits (the tenant's totals) and each of its users' accounts' share of them.

    Example: `blocks tenant get team-a --json`
    """
    from ..runtime import auth
    from ..runtime import tenants as tn

    row = next((r for r in auth.tenants(embedded(data_dir, "tenants", running=False)) if r["tenant"] == tenant), None)
    if row is None:
        raise LookupError(f"no tenant {tenant!r} (blocks tenant list)")
    if as_json:
        _print_json(row)
        return
    table = _table("account", *tn.SPLIT)
    table.add_row("[bold]tenant total[/]", *(str(row["limits"][n]) for n in tn.SPLIT))
    for acc, share in row["shares"].items():
        table.add_row(acc, *(str(share[n]) for n in tn.SPLIT))
    console.print(table)
    console.print(f"pending creates: {row['limits']['pending_creates']} (the tenant's, counted by the parser)")
    if not row["fits"]:
        err.print("[yellow]its limits are smaller than its users: some accounts got 1 (more than the tenant's "
                  "figure in all); raise the limit or remove a user[/]")


@tenant_app.command("remove")
def tenant_remove(tenant: str = typer.Argument(...), data_dir: Path = DataDir) -> None:
    """Remove a tenant's account: its clients are disconnected and its credentials deleted. Its
    blocks stay (delete them first: `blocks delete BID`).

    Example: `blocks tenant remove team-a`
    """
    from ..runtime import auth

    data_dir = embedded(data_dir, "tenants")
    if not auth.remove_tenant(data_dir, tenant):
        raise LookupError(f"no tenant {tenant!r}")
    _store_limit(tenant, data_dir, remove=True)
    console.print(f"tenant [bold]{tenant}[/] removed")


@user_app.command("add")
def tenant_user_add(
    tenant: str = typer.Argument(...),
    name: str = typer.Argument(..., help="The user's name: it logs in as TENANT.NAME."),
    as_json: bool = typer.Option(False, "--json", help="Print {tenant, account, user, new, credentials}."),
    data_dir: Path = DataDir,
) -> None:
    """Add a user to a tenant (one per client): its own password, credentials file and NATS account
    (tenant-TENANT.NAME), so no other user of the tenant reads its tasks or their answers. The
    tenant's limits are split anew, one more share: refused (exit 2, naming the flag to raise) when
    a limit cannot give each user at least one, or an account holds more than its new share (read
    through the server's system account: an account using every connection of its share is read too).
    A new user name that differs from one of the tenant's only in case (`Dash` beside `dash`) is
    refused (exit 2).

    Example: `blocks tenant user add team-a dashboard --json`
    """
    from ..runtime import auth

    new, path = auth.add_tenant_user(embedded(data_dir, "tenants"), tenant, name)
    _say(tenant, name, new, path, as_json)


@user_app.command("remove")
def tenant_user_remove(tenant: str = typer.Argument(...), name: str = typer.Argument(...), data_dir: Path = DataDir) -> None:
    """Remove one of a tenant's users (its connections are closed; its share of the limits goes
    back to the tenant's other users). Not its first user, main (exit 2): that goes with the tenant.

    Example: `blocks tenant user remove team-a dashboard`
    """
    from ..runtime import auth

    if not auth.remove_tenant_user(embedded(data_dir, "tenants"), tenant, name):
        raise LookupError(f"tenant {tenant!r} has no user {name!r}")
    console.print(f"tenant [bold]{tenant}[/] user [bold]{name}[/] removed")


@tenant_app.command("history")
def tenant_history(
    bid: str = typer.Argument(..., help="One of the tenant's blocks."),
    credentials: Path = typer.Option(..., "--credentials", "-c", exists=True, dir_okay=False,
                                     help="The tenant user's credentials file (`blocks tenant add T --json`: credentials)."),
    start: int = typer.Option(1, "--from", min=1, help="From this stream sequence (a page's `next`)."),
    limit: int = typer.Option(100, "--limit", min=1, max=500, help="Events per page."),
    every: bool = typer.Option(False, "--all", help="Every page from --from to the end."),
    as_json: bool = typer.Option(False, "--json", help="Print {block_id, events: [{seq, subject, event}], next, more}."),
) -> None:
    """A tenant's block's stored events, oldest first, as the tenant may see them (its own creates'
    only), asked as the tenant (request `aios.block.B.history`). Not the tenant's block, or none:
    exit 1.

    Example: `blocks tenant history team-a-web -c data/tenants/team-a/main.json --all`
    """

    from ..bus.history import ask_all_history, ask_history
    from .common import _run, err

    async def go() -> dict[str, Any]:
        async with tenant_connection(credentials) as nc:
            if every:
                return await ask_all_history(nc, bid, start, limit)
            return await ask_history(nc, bid, start, limit)

    try:
        page = _run(go())
    except LookupError as exc:  # not the tenant's block, or none: the desk says which alike
        err.print(f"[red]{escape(str(exc.args[0]))}[/]")
        raise typer.Exit(1) from None
    if as_json:
        _print_json(page)
        return
    table = _table("seq", "time", "event")
    for e in page["events"]:
        table.add_row(str(e["seq"]), str((e.get("event") or {}).get("time", "")),
                      e["subject"].removeprefix(f"aios.block.{bid}."))
    console.print(table)
    if page["more"]:
        console.print(f"more: --from {page['next']}")


# -- `blocks submit --tenant T` / `-c CREDS`: a block of the tenant's own -------------------------------
def tenant_credentials(tenant: str | None, credentials: Path | None, data_dir: Path) -> Path:
    """The credentials file a tenant's command logs in with: ``-c FILE`` as given (its tenant must
    be ``tenant``, when named), else ``--tenant T``'s first user's, which ``blocks tenant add T``
    wrote into the data dir. An unknown tenant is :class:`LookupError` (exit 1)."""

    from ..runtime import auth
    from ..runtime import tenants as tn

    if credentials is None:
        assert tenant is not None
        path = auth.credentials_path(data_dir, tenant, tn.FIRST_USER)  # ValueError: not a tenant name
        if not path.exists():
            raise LookupError(f"no tenant {tenant!r} in {Path(data_dir).resolve()}: `blocks tenant add {tenant}` makes it "
                              f"(and its credentials file {path}), or give the file with -c")
        return path
    try:
        text = Path(credentials).read_text()
    except OSError as exc:
        raise ValueError(f"{credentials} is no tenant credentials file (`blocks tenant add T --json`): {exc}") from None
    named = read_credentials(text, credentials).get("tenant")  # (ValueError: every field it lacks)
    if tenant is not None and named != tenant:
        raise ValueError(f"{credentials} is tenant {named!r}'s credentials, not {tenant!r}'s")
    return Path(credentials)


async def submit_as_tenant(credentials: Path, spec: dict[str, Any], wait: bool, timeout: float, on_event: Any,
                           on_submitted: Any = None) -> tuple[str, int, str | None, dict[str, Any]]:
    """Publish ``spec`` as the tenant's create (``aios.block.B.create`` in its account: the server
    hands it to the gateway, which stores it as ``aios.tenant.T.block.B.create``; the PubAck's seq
    is the block's gen) and, with
    ``wait``, follow the tenant's relayed events of B (subscribed before the publish: the relay is
    live) until the one that ends this create, ``gen`` equal to it: (block id, gen, terminal kind or
    ``None`` without ``wait``, its event). ``TimeoutError`` past ``timeout``. ``on_submitted(bid,
    gen, tenant)`` once the PubAck came, ``on_event(subject, event)`` for each event of this create."""
    import asyncio
    import json
    import uuid

    import nats.errors
    from nats.js.errors import NoStreamResponseError

    from ..bus import subjects
    from ..bus.catalog import E
    from ..bus.history import relayed
    from ..schemas.spec import check_id
    from .client import Request, event_data, event_kind

    given = spec.get("blockId")
    bid = check_id(given, "blockId") if given is not None else f"blk-{uuid.uuid4().hex[:12]}"
    spec = {**spec, "blockId": bid}
    msg_id = f"create:{bid}:{uuid.uuid4().hex}"
    body = json.dumps({"specversion": "1.0", "id": msg_id, "source": "urn:aios-blocks:blocks-submit", "type": E.block_create.type,
                       "datacontenttype": "application/json", "data": spec}).encode()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    async with tenant_connection(credentials) as nc:
        if wait:
            await nc.subscribe(subjects.block_all(bid), cb=queue.put)
            await nc.flush()
        try:
            ack = await nc.jetstream(timeout=10).publish(E.block_create.subject(bid=bid), body, headers={
                "Content-Type": "application/cloudevents+json", "Nats-Msg-Id": msg_id})
        except (nats.errors.NoRespondersError, NoStreamResponseError, nats.errors.TimeoutError) as exc:
            # (no responders: the gateway, which stores a tenant's create, is not running)
            raise LookupError(f"the system did not take the create ({type(exc).__name__}): is `blocks up` running, "
                              "and the tenant still there (`blocks tenant list`)?") from None
        if on_submitted is not None:
            tenant = json.loads(await asyncio.to_thread(Path(credentials).read_text)).get("tenant")
            on_submitted(bid, ack.seq, tenant)
        if not wait:
            return bid, ack.seq, None, {}
        req = Request(bid, "create", ack.seq)
        async with asyncio.timeout(timeout):
            while True:
                msg = await queue.get()
                if msg.reply or relayed(msg.subject) is None:  # a request of the tenant's, not an event
                    continue
                try:
                    env = json.loads(msg.data)
                except ValueError:
                    continue
                data = event_data(cast("EventDoc", env)) if isinstance(env, dict) else {}
                if data.get("gen") in (None, ack.seq):
                    on_event(msg.subject, env)
                ended = req.outcome(event_kind(msg.subject), data)
                if ended is not None:
                    return bid, ack.seq, event_kind(msg.subject), env


def submit_command(spec: JSONObject, tenant: str | None, credentials: Path | None, wait: bool, timeout: float,
                   data_dir: Path) -> int:
    """``blocks submit --tenant T`` / ``-c CREDS`` (``cli.blocks.submit``): as ``submit``'s exit codes; 1 an unknown tenant or a
    create nobody took, 2 refused credentials or a usage mistake."""
    from ..bus.connection import Unreachable
    from .client import TERMINAL

    async def go(path: Path) -> tuple[str, int, str | None, Any]:
        try:
            return await submit_as_tenant(path, dict(spec), wait, timeout, lambda s, e: console.print(_line(s, e)),
                                          lambda b, g, t: console.print(f"submitted [bold]{b}[/] as tenant [bold]{t}[/] "
                                                                        f"(gen {g})"))
        except Unreachable as exc:  # a password the server refuses is no unreachable server
            if "authorization" in str(exc).lower():
                raise PermissionError(str(exc)) from None
            raise

    try:
        path = tenant_credentials(tenant, credentials, data_dir)
        _, _, kind, env = _run(go(path))
    except LookupError as exc:
        err.print(f"[red]{escape(str(exc.args[0]))}[/]")
        return 1
    except ValueError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    except TimeoutError:
        err.print(f"[red]timed out after {timeout}s[/]")
        return 5
    except PermissionError:
        err.print(f"[red]the server refused the credentials in {escape(str(path))}[/]: wrong password, or the tenant "
                  "or its user was removed (`blocks tenant list`; `blocks tenant add T` writes the first user's file again)")
        return 2
    if kind is None:
        return 0
    print_rejection(kind, env)
    return TERMINAL[kind]
