"""What the stream and the state hold: ``watch``, ``replay``, ``explain``, ``recover``, ``check``,
``state digest``, and the contract they follow (``subjects``, ``asyncapi``)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import typer
from rich.markup import escape

from .common import DataDir, _request, _run, _seconds_over, _with_client, console, err
from .render import _line, _plain, _render_explain, _table
from .tenants import Credentials

if TYPE_CHECKING:
    from ..projections.base import EventDoc
    from .client import Client
    from .pending import Waiting

T = TypeVar("T")

def watch(
    bid: str = typer.Argument("*", help="Block id, or all blocks."),
    since: int = typer.Option(None, "--since", min=1,
                              help="First the stored events from this stream sequence on (a `replay`'s or "
                                   "`tenant history`'s seq), then the live ones."),
    credentials: Path = Credentials,
    data_dir: Path = DataDir,
) -> None:
    """Print lifecycle events live as they happen (Ctrl-C stops). As a tenant (`-c CREDS`): its own
    blocks' events, each once; `--since` needs a block id then, and another's block is refused as
    a missing one (exit 1).

    Example: `blocks watch`, `blocks watch blk-1234 --since 1`, `blocks watch team-a-web -c CREDS --since 1`
    """
    if credentials is not None:
        _tenant_watch(bid, since, credentials)
        return

    async def go(c: Client) -> None:
        async for subject, env in c.follow(bid, from_start=False, from_seq=since):
            _print_watched(subject, env)

    try:
        _request(go, data_dir)
    except KeyboardInterrupt:
        pass


def _print_watched(subject: str, env: EventDoc) -> None:
    """One line of ``blocks watch`` (the admin's and a tenant's): time, block, what happened."""
    console.print(f"{str(env.get('time', ''))[11:23]} {subject.split('.')[2]:<20} {_line(subject, env)}")


def _as_tenant(coro: Coroutine[Any, Any, T]) -> T:
    """Run a tenant's command: a block that is not its own (or none) exits 1 with the desk's words,
    a usage mistake 2."""
    try:
        return _run(coro)
    except LookupError as exc:
        err.print(f"[red]{escape(str(exc.args[0]))}[/]")
        raise typer.Exit(1) from None
    except ValueError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None


def _tenant_watch(bid: str, since: int | None, credentials: Path) -> None:
    """``blocks watch -c``: the desk's history from ``since``, then the relay's live events (``bus.history.follow``)."""
    from ..bus.history import follow
    from ..schemas.spec import check_id
    from .tenants import tenant_connection

    async def go() -> None:
        if bid != "*":
            check_id(bid, "block id")
        async with tenant_connection(credentials) as nc:
            async for _, subject, env in follow(nc, bid, since):
                _print_watched(subject, cast("EventDoc", env))

    with contextlib.suppress(KeyboardInterrupt):
        _as_tenant(go())


def replay(
    bid: str = typer.Argument("*", help="Block id, or every block."),
    as_json: bool = typer.Option(False, "--json", help="One JSON event per line."),
    data_dir: Path = DataDir,
) -> None:
    """A block's whole story from JetStream, in order, as a timeline: sequence, time (the event's
    own, else when the stream stored it), event; its dead letters too, in their place ("dead
    letter: CONSUMER gave up after N deliveries: ERROR", `blocks dlq`). `--json` lines carry
    `stored` too.

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
            parts = subject.split(".")  # a dead letter's block is in the subject it keeps: aios.dlq.C.aios.block.B...
            console.print(f"{seq:>7} {at[11:23]} {parts[5 if parts[1] == 'dlq' else 2]:<20} {_line(subject, env)}")
        return 0

    raise typer.Exit(_request(go, data_dir))


def explain(
    bid: str,
    as_json: bool = typer.Option(False, "--json", help="The explanation as one JSON document."),
    inputs: bool = typer.Option(False, "--inputs", help="Rebuild every policy call's input by replaying the stream and check it against the recorded digest."),
    credentials: Path = Credentials,
    data_dir: Path = DataDir,
) -> None:
    """Why the block is where it is, from the stream alone: candidates and filtered clusters, each
    cluster's dry_run score and node/GPUs (and nodes rejected by affinity), why the final cluster
    won, each instance's node and GPUs, failures with reasons, policy calls. With ``--inputs``,
    each call's input is rebuilt by replay (inputs are not stored) and checked against its digest.
    As a tenant (`-c CREDS`): from its block's history (the gateway's tenant desk), no `--inputs`
    nor pending-queue line (they read the whole system); another's block is refused as a missing
    one (exit 1).

    Example: `blocks explain blk-1234 --json --inputs`, `blocks explain team-a-web -c CREDS`
    """
    from ..projections.explain import explain as fold

    if credentials is not None:
        if inputs:
            err.print("[red]error:[/] --inputs replays the whole system stream: not for a tenant (-c)")
            raise typer.Exit(2)
        raise typer.Exit(_as_tenant(_tenant_explain(bid, credentials, as_json)))

    async def go(c: Client) -> int:
        events = [(s, e) for s, e, _ in await c.history(bid)]
        if not events:
            err.print(f"[yellow]no events for {bid}[/]")
            return 1
        x = fold(events)
        from .pending import preempted_note, why_waiting

        waiting = await why_waiting(c.store, bid)  # the pending queue, live (docs/priority.md)
        if waiting is not None:
            x["pending"] = waiting
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
        if waiting is not None:
            console.print(escape(waiting_line(waiting) + preempted_note(waiting["reason"], waiting["preempted_by"], "(it never preempts in turn)")
                                 + ("; its preemption is under way (victims draining)" if waiting["preempting"] else "")))
        return 0

    raise typer.Exit(_run(_with_client(data_dir, go)))


def waiting_line(waiting: Waiting) -> str:
    """Where ``blocks explain``'s block waits: the primary queue (scope ``_``, which it printed as
    "the pending queue _") is the pending queue; a virtual cluster's is named."""
    from ..state.queue import PRIMARY

    scope = waiting["scope"]
    where = "" if scope in ("", PRIMARY) else f" of virtual cluster {scope}"
    ahead = ", ".join(waiting["ahead"]) or "nobody"
    return (f"waits in the pending queue{where} at position {waiting['position']} of {waiting['length']} "
            f"(behind {ahead}): {waiting['reason']}")


async def _tenant_explain(bid: str, credentials: Path, as_json: bool) -> int:
    """``blocks explain -c``: the fold of the tenant's history of ``bid`` (every page)."""
    from ..bus.history import ask_all_history
    from ..projections.explain import explain as fold
    from ..schemas.spec import check_id
    from .tenants import tenant_connection

    check_id(bid, "block id")
    async with tenant_connection(credentials) as nc:
        page = await ask_all_history(nc, bid, 1, 500)
    if not page["events"]:
        err.print(f"[yellow]no events for {escape(bid)}[/]")
        return 1
    x = fold([(e["subject"], e["event"]) for e in page["events"]])
    if as_json:
        print(json.dumps(x, indent=2, default=str))
    else:
        _render_explain(x)
    return 0


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
        if rep.announced:
            console.print(f"{rep.announced} status steps Redis had taken were published to the stream first "
                          "(their publish had failed: docs/reliability.md, Announcements)")
        for a in rep.anomalies[:20]:
            err.print(f"[yellow]anomaly[/] {escape(a)}")
        return 0

    raise typer.Exit(_run(_with_client(data_dir, go)))


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


def subjects_(
    markdown: bool = typer.Option(False, "--markdown", help="Print docs/subjects.md's table (generated from the catalog)."),
    handlers: bool = typer.Option(False, "--handlers", help="Each durable consumer's subjects and the module:function handling each."),
) -> None:
    """Every NATS subject the system uses: who publishes it, whether the stream stores it, which
    durable consumers take it; `--handlers`: the function each consumer runs for each subject
    (read from the workers' bindings). Example: `blocks subjects`, `blocks subjects --handlers --markdown`"""
    from ..bus import catalog_doc

    if handlers:
        from ..runtime import routes

        if markdown:
            print(routes.markdown())
            return
        t = _table("durable consumer", "subject", "handler")
        for row in routes.rows():
            t.add_row(*_plain(*row))
        console.print(t)
        return
    if markdown:
        print(catalog_doc.catalog_markdown())
        return
    t = _table("subject", "published by", "stored", "durable consumers", "message id", "meaning")
    for event_row in catalog_doc.catalog_rows():
        t.add_row(*_plain(*event_row))
    console.print(t)


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
