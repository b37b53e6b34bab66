"""``blocks rebalance`` (issue 38, docs/rebalance.md): the moves the rebalancer policy would make
now, per cluster, and (without ``--dry-run``) the requests for them (``block.move.requested``;
the controller carries each out make-before-break)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from .common import DataDir, _request, console, err
from .render import _plain, _print_json, _table

if TYPE_CHECKING:
    from .client import Client


def rebalance(
    dry_run: bool = typer.Option(False, "--dry-run", help="List every move and the capacity it frees; change nothing."),
    max_moves: int | None = typer.Option(None, "--max-moves", min=0,
                                         help="The most moves per cluster, 0 or more (default: AIOS_REBALANCE_MAX_MOVES)."),
    cluster: list[str] = typer.Option([], "--cluster", help="Only this cluster (repeat for more; default: every cluster)."),
    policy_uri: str = typer.Option("", "--policy", help="The rebalancer policy (a policyRuleURI; default: AIOS_REBALANCE_POLICY)."),
    as_json: bool = typer.Option(False, "--json", help='An object with "moves" (one entry per move, its cluster) and "clusters" (each one\'s input summary and reason).'),
    data_dir: Path = DataDir,
) -> None:
    """Move instances so that pending blocks fit, or the clusters fragment less (docs/rebalance.md).

    For each cluster, the rebalancer policy (default builtin:rebalance-min) gets the nodes, their
    FGD fragmentation, the pending blocks that may go there and the movable instances; each move
    it answers is requested (block.move.requested: make-before-break, the old instance serves
    until the new one is ready). `--dry-run` lists every move, the GPUs it frees on its source
    and the fragmentation before and after, and changes nothing. Exit 0 done, 1 an unknown cluster or
    the policy failed in some cluster (--json too: that cluster's "error" says why).

    Example: `blocks rebalance --dry-run`, `blocks rebalance --cluster c1 --max-moves 4 --json`
    """
    from ..handlers import rebalance as hr
    from ..policies.runtime import PolicyRuntime
    from ..settings import load as load_settings
    from ..state.priority import PriorityStore
    from ..workers.rebalancer import plan_rounds

    settings = load_settings()
    k = settings.rebalance_max_moves if max_moves is None else max_moves
    rule = {"name": "rebalancer", "policyRuleURI": policy_uri or settings.rebalance_policy}

    async def go(c: Client) -> tuple[list[Any], int]:
        runtime = PolicyRuntime(lookup=c.store.policy_get)  # registry:NAME from the system's registry

        async def invoke(r: dict[str, Any], data: dict[str, Any]) -> Any:
            return await runtime.invoke(r, "cli.rebalance", data, {})

        rounds = await plan_rounds(c.store, invoke, rule, k, settings.queue_window, list(cluster) or None,
                                   trigger=hr.Trigger.MANUAL)
        if dry_run:
            return rounds, 0
        known = hr.gens((await PriorityStore(c.store.r).placed())[0])
        now = time.time()
        events = [e for r in rounds for e in hr.requests(r.cluster, r.output, known, r.trigger, now)]
        if events:
            await c.bus.emit_all(events)
        return rounds, len(events)

    rounds, asked = _request(go, data_dir, store_only=dry_run)
    moves = [{"cluster": r.cluster, **m} for r in rounds for m in r.output.get("moves") or []]
    failed = any(r.error for r in rounds)
    if as_json:
        _print_json({"dry_run": dry_run, "moves": moves, "requested": asked, "clusters": [r.as_dict() for r in rounds]})
        if failed:  # each cluster's "error" says why
            raise typer.Exit(1)
        return
    for r in rounds:
        f = r.data.get("fragmentation") or {}
        frag = r.output.get("fragmentation") or {}
        head = f"cluster [bold]{escape(r.cluster)}[/]: fragmentation {f.get('ratio', 0):.3f} ({f.get('total', 0):g} thousandths of a GPU)"
        if frag:
            head += f", {frag.get('after', 0):g} after the moves"
        console.print(head)
        console.print("  " + escape(r.error or r.skipped or str(r.output.get("reason", ""))))
    if moves:
        t = _table("cluster", "block", "instance", "from", "to", "GPUs freed", "reason")
        for m in moves:
            t.add_row(*_plain(m["cluster"], m["block_id"], m["instance_id"], m["from"], m["to"], m.get("gpus_freed", 0),
                              m.get("reason", "")))
        console.print(t)
    if dry_run:
        console.print(f"dry run: {len(moves)} move(s), nothing requested")
    else:
        console.print(f"{asked} move(s) requested; follow with: blocks watch BID")
    if failed:
        err.print("[red]the rebalancer policy failed in some cluster[/]")
        raise typer.Exit(1)
