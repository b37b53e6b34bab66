"""The block commands: ``submit`` (and its dry run), ``get``, ``list``, ``scale``, ``reassign``,
``move`` (make-before-break, docs/rebalance.md), ``delete``, ``top``, and ``examples`` (the shipped
specs to submit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import typer
from rich.markup import escape

from ..urls import mask
from .common import (
    DataDir,
    NoWait,
    Timeout,
    _block_id,
    _follow_request,
    _load,
    _request,
    _run,
    _seconds_over,
    _urls,
    _with_store,
    console,
    err,
)
from .render import (
    _line,
    _plain,
    _print_block,
    _print_json,
    _render_plan,
    _spec_errors,
    _table,
    print_rejection,
)

if TYPE_CHECKING:
    from ..schemas.records import JSONObject
    from .client import Client

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
    no_queue: bool = typer.Option(
        False, "--no-queue",
        help="A block that fits nowhere fails at once (exit 3 with --wait) instead of waiting in the pending queue "
        "(sets the spec's `queue: false`; docs/priority.md).",
    ),
    tenant: str = typer.Option(None, "--tenant", "-t", metavar="T",
                               help="Submit as tenant T (its user T.main, whose credentials `blocks tenant add T` wrote in "
                                    "the data dir; or -c FILE): the block is T's (docs/security.md \"Tenants\")."),
    credentials: Path = typer.Option(None, "--credentials", "-c", exists=True, dir_okay=False,
                                     help="Submit as the tenant user of this credentials file (`blocks tenant add T --json`, "
                                          "`blocks tenant user add T NAME --json`: credentials)."),
    data_dir: Path = DataDir,
) -> None:
    """Submit a block spec (YAML or JSON). Exit code with --wait: 0 ready, 3 failed (or the create
    dead-lettered: the letter's error and its `blocks dlq replay` are printed), 4 rejected, 5 timeout;
    1 when --if-index finds the state changed.

    As a tenant (--tenant T, or -c CREDS): logs in as the tenant's user and publishes the tenant's
    create; --wait follows the tenant's own events of the block (what `blocks watch -c` shows).
    A password the server refuses exits 2, an unknown tenant 1.

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
    if (tenant is not None or credentials is not None) and (dry_run or if_index is not None):
        raise typer.BadParameter("a tenant's submit publishes through its own account: no --dry-run, no --if-index "
                                 "(they read the system's state)", param_hint="--tenant")
    spec = _load(file)
    if no_queue:
        spec["queue"] = False
    if tenant is not None or credentials is not None:
        from .tenants import submit_command

        raise typer.Exit(submit_command(spec, tenant, credentials, wait, timeout, data_dir))
    if dry_run:
        raise typer.Exit(_dry_run(spec, file, as_json, data_dir))

    from .client import DEAD_LETTERED, TERMINAL

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
        if kind.startswith(DEAD_LETTERED):  # it waited out its timeout, naming nothing (docs/dead-letters.md)
            d = env.get("data") or {}
            err.print(f"[red]dead-lettered[/]: {escape(str(d.get('consumer')))} gave up on this create after "
                      f"{d.get('deliveries')} deliveries: {escape(str(d.get('error')))}; once the cause is fixed: "
                      f"blocks dlq replay {kind.split()[-1]}")
            return 3
        print_rejection(kind, env)
        return TERMINAL[kind]

    raise typer.Exit(_request(go, data_dir))


def _dry_run(spec: JSONObject, file: Path, as_json: bool, data_dir: Path) -> int:
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
                from ..state.views import short_of

                short = {"short": short_of(block["short"])} if "short" in block else {}
                print(json.dumps({**block, **short, "instances": await c.store.instances(bid)}, indent=2, default=str))
        else:
            block = await _print_block(c, bid)
        if block is None:
            err.print(f"[red]no block {bid}[/]")
            return 1
        return 0

    raise typer.Exit(_run(_with_store(data_dir, go)))


def list_blocks(
    limit: int = typer.Option(100, min=1, help="At most this many blocks."),
    as_json: bool = typer.Option(False, "--json", help="The rows as a JSON list (id, status, cluster, reason, gen, instances, short)."),
    pending: bool = typer.Option(False, "--pending", help="Only the blocks waiting in the pending queue, in queue order: "
                                 "position, priority, age, reason (docs/priority.md)."),
    data_dir: Path = DataDir,
) -> None:
    """List blocks, newest first: status, cluster, instance count, reason; `--pending`: the blocks
    waiting in the pending queue, in queue order. Reads Redis only.

    A ready block below its minInstances that the reconciler could not bring back shows as
    `ready (short 0/1 since 12:01:03)`, with why in its reason column (docs/reliability.md, "Short blocks").
    A rejected block's reason is each problem of its spec, `$.path: message` (`--json`: as stored, a JSON list).

    Example: `blocks list --limit 20`, `blocks list --json`, `blocks list --pending`
    """
    if pending:
        _list_pending(as_json, data_dir)
        return
    from ..state.views import block_rows, describe_short, open_reader

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
        short = row["short"]  # the condition beside the status, its why in the reason column (one line a block)
        status = row["status"] + (f" ({describe_short({**short, 'reason': ''})})" if short else "")
        reason = (short.get("reason") if short else None) or row["reason"] or ""
        errors = _spec_errors(reason)  # a rejected block's: each problem as `blocks get` says it, not JSON
        if errors is not None:
            reason = "; ".join(f"{e.get('path')}: {e.get('message')}" for e in errors)
        t.add_row(*_plain(row["id"], status, row["cluster"] or "", row["instances"], reason))
    console.print(t)


def _list_pending(as_json: bool, data_dir: Path) -> None:
    from .pending import PendingRow, preempted_note, rows

    async def go(c: Client) -> list[PendingRow]:
        return await rows(c.store)

    out = _request(go, data_dir, store_only=True)
    if as_json:
        _print_json(out)
        return
    t = _table("block", "queue", "position", "priority", "age", "reason")
    for r in out:
        extra = preempted_note(r["reason"], r["preempted_by"]) + ("; preempting" if r["preempting"] else "")
        t.add_row(*_plain(r["id"], r["scope"], r["position"], f"{r['priority']} {r['priorityClass']}".strip(),
                          f"{r['age_s']:g}s", r["reason"] + extra))
    console.print(t)


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


def reassign(bid: str, instance_id: str, no_wait: bool = NoWait, timeout: float = Timeout, data_dir: Path = DataDir) -> None:
    """Move one instance elsewhere (resourceAllocator action `reassignment`) and wait until its
    replacement runs. Exit 0 moved, 3 failed, 5 timeout, 1 unknown block or instance.

    Example: `blocks reassign blk-1234 blk-1234-0`
    """
    raise typer.Exit(_follow_request(lambda c: c.reassign_request(bid, instance_id), not no_wait, timeout, data_dir))


#: how often ``blocks move --wait`` reads the move's record
MOVE_POLL_S = 0.2


def move(
    bid: str,
    instance_id: str,
    to: str = typer.Option("", "--to", metavar="NODE", help="The node to move it to (a node of the block's cluster); "
                           "default: the resourceAllocator chooses any node but the instance's own."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow the move until it completed or failed."),
    timeout: float = typer.Option(300.0, "--timeout", help="With --wait: give up after this many seconds (exit 5).",
                                  callback=_seconds_over()),
    reason: str = typer.Option("requested by hand", "--reason", help="Why, in words: shown in every step's event and in "
                               "`blocks explain`."),
    move_id: str = typer.Option("", "--move-id", help="The move's id (default: a new one); asking again with the same id "
                                "is the same move."),
    as_json: bool = typer.Option(False, "--json", help="Print the move as JSON: move_id, block_id, instance_id, to_node, "
                                 "status (requested, or with --wait completed / failed), new_instance_id, node, reason."),
    data_dir: Path = DataDir,
) -> None:
    """Move one instance of a ready block, make-before-break: a new instance is placed (atomic
    reservation) and started, traffic switches to it once it is ready, then the old one drains (its
    tasks in flight finish) and is removed. The block never has fewer ready instances than
    minInstances, nor more moving at once than its `maxMoving` (default 1); the cluster's moves are
    rate limited (AIOS_MOVE_RATE_LIMIT). A move that fails leaves the old instance serving. Needs
    the admin role. Exit 0 requested (with --wait: completed), 3 failed (the reason), 5 timeout,
    1 unknown block or instance, 2 a bad id.

    Example: `blocks move blk-1234 blk-1234-0 --to n3 --wait`
    """

    async def go(c: Client) -> int:
        req = await _publish_move(c, bid, instance_id, to, reason, move_id)
        out: MoveOutcome = {"move_id": req.move_id, "block_id": bid, "instance_id": instance_id, "to_node": to,
                            "status": "requested", "new_instance_id": "", "node": "", "reason": ""}
        if not as_json:
            console.print(escape(f"move {req.move_id} of {instance_id} requested; follow with: blocks explain {bid}"))
        if not wait:
            if as_json:
                console.print_json(json.dumps(out))
            return 0
        try:
            rec = await _move_outcome(c, bid, req.move_id, timeout)
        except TimeoutError:
            err.print(f"[red]move {escape(req.move_id)} not over after {timeout:g}s[/]; follow with: blocks explain {escape(bid)}")
            return 5
        out["status"], out["new_instance_id"] = rec["phase"], rec.get("new", "") if rec.get("node") else ""
        out["node"], out["reason"] = rec.get("node", ""), rec.get("why", "")
        if as_json:
            console.print_json(json.dumps(out))
        elif rec["phase"] == "completed":
            console.print("[green]move done[/]: " + escape(f"{instance_id}@{rec.get('from', '')} -> {rec['new']}@{rec['node']}"))
        else:
            err.print(f"[red]move failed[/]: {escape(str(rec.get('why', '')))}")
        return 0 if rec["phase"] == "completed" else 3

    raise typer.Exit(int(_request(go, data_dir)))


class MoveOutcome(TypedDict):
    """``blocks move --json``'s document: the request, and with --wait how it ended."""

    move_id: str
    block_id: str
    instance_id: str
    to_node: str
    #: requested, completed or failed
    status: str
    new_instance_id: str
    node: str
    reason: str


async def _publish_move(c: Client, bid: str, iid: str, to: str, reason: str, move_id: str) -> Any:
    """Check the ids (an unknown block or instance is refused here, exit 1) and publish the request."""
    import time
    import uuid

    from ..bus.catalog import E
    from ..schemas.moves import MoveRequested
    from ..schemas.spec import check_id

    check_id(bid, "block id")
    check_id(iid, "instance id")
    if to:
        check_id(to, "node id")
    mid = check_id(move_id, "move id") if move_id else f"mv-{uuid.uuid4().hex[:12]}"
    block, insts = await c.store.block_view(bid)
    if block is None:
        raise LookupError(f"no block {bid!r}")
    if iid not in insts:
        raise LookupError(f"block {bid!r} has no instance {iid!r}")
    req = MoveRequested(bid, mid, iid, to_node=to, reason=reason, requested_by="cli", gen=int(block["gen"]), at=time.time())
    await c.bus.emit(E.block_move_requested, req)
    return req


async def _move_outcome(c: Client, bid: str, mid: str, timeout: float) -> dict[str, Any]:
    """The move's record once it is over (completed / failed); TimeoutError after ``timeout``."""
    import asyncio

    from ..state.moves import MoveStore

    ms = MoveStore(c.store.r)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        rec = await ms.get(bid, mid)
        if rec is not None and rec.get("phase") in ("completed", "failed"):
            return rec
        await asyncio.sleep(MOVE_POLL_S)
    raise TimeoutError(mid)


def delete(bid: str, no_wait: bool = NoWait, timeout: float = Timeout, data_dir: Path = DataDir) -> None:
    """Delete a block: every instance is removed and its resources released, then `deleted`.
    Waits for `deleted`. Exit 0 deleted, 5 timeout, 1 unknown or already deleted.

    Example: `blocks delete blk-1234`
    """
    raise typer.Exit(_follow_request(lambda c: c.delete(bid), not no_wait, timeout, data_dir))


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
    at once (the live view too) when the collector has nothing for BID (yet).

    Example: `blocks top`, `blocks top blk-1234`, `blocks top blk-1234 --json`
    """
    import asyncio

    from rich.live import Live

    from . import top as topview

    def missing(data: topview.AllBlocks | topview.OneBlock) -> bool:
        return "blocks" not in data and data.get("block") is None and not data.get("instances")

    async def go(c: Client) -> int:
        data = await topview.read(c.store, bid)
        if as_json:
            print(json.dumps(data, indent=1, sort_keys=True))
        if missing(data):  # said, not an empty table (the live view showed one for ever)
            err.print(f"[red]no metrics for block {escape(bid or '')}[/] (unknown, not serving yet, or no collector: `blocks up` starts one)")
            return 1
        if as_json or once:
            if not as_json:
                console.print(topview.table(data, bid))
            return 0
        if not console.is_terminal:  # piped: a Live view writes nothing until it ends (Ctrl-C, a kill)
            while True:
                console.print(topview.table(data, bid))  # (rich flushes each print)
                await asyncio.sleep(interval)
                data = await topview.read(c.store, bid)
        with Live(topview.table(data, bid), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(topview.table(await topview.read(c.store, bid), bid))

    try:
        raise typer.Exit(_request(go, data_dir, store_only=True))
    except KeyboardInterrupt:
        pass
