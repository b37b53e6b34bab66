"""How the CLI shows things: tables, JSON, one line per event, a dry-run plan, a block, an
explanation. Shared by the command modules; only typer and rich at import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from .common import console, err

if TYPE_CHECKING:
    from rich.table import Table

    from ..handlers.plan import PlanDoc
    from ..projections.base import EventDoc
    from ..projections.explain import AutoscalerStory, Calls, Explanation, MoveStory, Round
    from ..schemas.records import AdaptTable, BlockIR, BlockRecord, JSONObject
    from .client import Client

def _plain(*values: Any) -> list[str]:
    """Table cells of data (ids, reasons, labels, a user's strings): shown as they are, never read
    as Rich markup (``x[ocr]y`` stays ``x[ocr]y``)."""
    return [escape(str(v)) for v in values]


def _line(subject: str, env: EventDoc) -> str:
    """One stored event on one line (its policy calls indented below): ``projections.lines``."""
    from ..projections.lines import line

    kind, detail, colour = line(subject, env)
    return f"[{colour}]{kind:<32}[/] {escape(detail)}"


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


def _render_plan(p: PlanDoc, file: Path) -> None:
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


async def _print_block(c: Client, bid: str) -> BlockRecord | None:
    block = await c.store.get_block(bid)
    if block is None:
        return None
    insts = await c.store.instances(bid)
    reason, errors = block.get("reason") or "", _spec_errors(block.get("reason"))
    from ..state.views import status_text

    title = escape(f"block {bid}: {status_text(block['status'], block.get('short'))}"
                   + (f" ({reason})" if reason and errors is None else ""))
    ir: BlockIR = block["ir"] if isinstance(block.get("ir"), dict) else {}
    if ir.get("priorityClass") or ir.get("preemptible") is False:  # docs/priority.md
        title += escape(f"; priority {ir.get('priorityClass') or '-'} ({ir.get('priority', 0)})"
                        + ("; not preemptible" if ir.get("preemptible") is False else ""))
    if not insts:  # (a rejected, failed or deleted block: no empty table)
        console.print(title)
        for e in errors or []:
            console.print(f"  [red]{escape(str(e.get('path')))}[/]: {escape(str(e.get('message')))}")
        console.print("no instances")
        return block
    t = _table("instance", "node", "gpus", "status", "endpoint", title=title)
    for iid, i in sorted(insts.items()):
        t.add_row(*_plain(iid, i["node"], ",".join(i["gpus"]), i["status"], i.get("endpoint") or ""))
    console.print(t)
    for e in errors or []:
        console.print(f"  [red]{escape(str(e.get('path')))}[/]: {escape(str(e.get('message')))}")
    return block


def _spec_errors(reason: Any) -> list[JSONObject] | None:
    """A rejected block's reason is its spec's errors as JSON (``[{"path", "message"}]``): them,
    to print one per line; ``None`` for any other reason (printed as it is)."""
    if not isinstance(reason, str) or not reason.startswith("["):
        return None
    try:
        errors = json.loads(reason)
    except ValueError:
        return None
    ok = isinstance(errors, list) and errors and all(isinstance(e, dict) and "message" in e for e in errors)
    return errors if ok else None


def _adapt_line(adapt: AdaptTable) -> str:
    """The adapt stage's table on one line (``projections.lines.adapt_line``)."""
    from ..projections.lines import adapt_line

    return adapt_line(adapt)


def _render_explain(x: Explanation) -> None:
    """``blocks explain``'s text: the explanation (``projections.explain``) part by part."""
    colour = {"ready": "green", "failed": "red", "rejected": "red"}.get(x["status"], "yellow")
    console.print(f"[bold]block {escape(x['block_id'])}[/]: [{colour}]{x['status']}[/]" + (f" - {escape(x['reason'])}" if x["reason"] else ""))
    for e in x["rejected_errors"]:
        console.print(f"  [red]{escape(e['path'])}[/]: {escape(e['message'])}")
    for r in x["rounds"]:
        console.print(_round_table(r))
    _explain_instances(x)
    _explain_short(x)
    for f in x["failures"]:
        console.print(f"[red]{escape(f['step'])} failed[/]: {escape(f['reason'])}")
    _explain_autoscaler(x.get("autoscaler") or {})
    _explain_moves(x.get("moves") or [])
    for tg in x.get("targets") or []:
        if tg["source"] != "autoscaler":
            why = f": {tg['reason']}" if tg.get("reason") else ""  # (`blocks scale --to` gives none)
            console.print(escape(f"instance target {tg['target']} asked by {tg['source']} {str(tg['time'])[11:19]}{why}"))
    _explain_calls(x["decisions"])


def _explain_short(x: Explanation) -> None:
    """Its spells below minInstances that the reconciler could not bring back (docs/reliability.md)."""
    from ..state.views import describe_short

    for sp in x.get("short") or []:
        line = describe_short(dict(sp))
        back = f"; whole again {str(sp['restored'])[11:19]}: {sp['restored_reason']}" if sp["restored"] else " (still short)"
        console.print(f"[{'yellow' if sp['restored'] else 'red'}]{escape(line + back)}[/]")


def _round_table(r: Round) -> Table:
    """One selection round: filtered clusters, each candidate's dry_run answer, the chosen one."""
    t = _table("cluster", "outcome", "dry_run score", "node / GPUs", "notes", title=escape(f"selection round {r['round']}: " + (r["why"] or "no cluster chosen")))
    for cid, why in sorted(r["filtered"].items()):
        t.add_row(escape(cid), "[red]filtered[/]", "", "", escape(why))
    for cid in r["candidates"]:
        d = r["dry_run"].get(cid)
        outcome = "[green]chosen[/]" if cid == r["chosen"] else "candidate"
        if d is None:
            t.add_row(escape(cid), outcome, "0 (no answer)" if cid in r["missing"] else "-", "", "")
            continue
        notes, rejected = d["error"] or d.get("skipped", ""), d["rejected_nodes"]
        if rejected:
            notes += (" " if notes else "") + f"{len(rejected)} node(s) rejected (affinity, capacity), e.g. " + "; ".join(
                f"{n}: {w}" for n, w in list(rejected.items())[:3]
            )
        t.add_row(escape(cid), outcome, *_plain(f"{d['score']:g}", f"{d['node']} {','.join(d['gpus'])}".strip(), notes))
    return t


def _explain_instances(x: Explanation) -> None:
    """The instances table, the health checker's verdicts, the adapt stage and adapted weights."""
    insts = sorted(x["instances"].items())
    if insts:
        t = _table("instance", "node", "GPUs", "placed by", "status", "health", title="instances")
        for iid, i in insts:
            t.add_row(*_plain(iid, i["node"], ",".join(i["gpus"]), i.get("action", ""), i.get("status", ""), i.get("health", "")))
        console.print(t)
        for iid, i in insts:
            for v in i.get("verdicts", []):
                console.print(f"[yellow]{escape(iid)} {escape(v['verdict'])}[/] " + escape(f"({v['policy']}): {v['reason']}"))
    if x.get("adapt"):
        console.print("adaptive affinity (adapt stage): " + escape(_adapt_line(x["adapt"])))
    for iid, i in insts:
        if i.get("topology"):
            topo = i["topology"]
            console.print(escape(f"  {iid} on {i['node']}: GPU link tier {topo['tier']} (best the node had free: {topo['best']})"))
        for a in i.get("adaptive") or []:
            console.print(escape(f"  {iid} on {i['node']}: entry {a['entry']} base weight {a['base']:g} -> adapted {a['weight']:g} ({a['why']})"))


def _explain_autoscaler(auto: AutoscalerStory) -> None:
    """The autoscaler's decisions (a table) and its failed ticks."""
    if auto.get("decisions"):
        t = _table("time", "count", "policy proposal", "policy's reason", "framework rules", title="autoscaler decisions")
        for a in auto["decisions"]:
            arrow = "[green]grew[/]" if (a["to"] or 0) > (a["from"] or 0) else "[yellow]shrank[/]"
            t.add_row(str(a["time"])[11:19], f"{a['from']} -> {a['to']} {arrow}", *_plain(f"{a['proposal']:g}", a["reason"], "; ".join(a["rules"])))
        console.print(t)
    for f in auto.get("failures") or []:
        quiet = f" ({f['quiet']} more failed ticks before, not stored)" if f.get("quiet") else ""
        console.print("[red]autoscaler tick failed[/] " + escape(f"{str(f['time'])[11:19]}: {f['reason']} - count stays {f['count']}{quiet}"))


def _explain_moves(moves: list[MoveStory]) -> None:
    """The block's make-before-break moves (docs/rebalance.md): one line each, then its steps."""
    colour = {"completed": "green", "failed": "red"}
    for m in moves:
        where = f"{m['instance']}@{m['from'] or '?'} -> " + (f"{m['new']}@{m['to']}" if m["new"] else (m["to"] or "any other node"))
        console.print(f"move {escape(m['move_id'])} [{colour.get(m['status'], 'yellow')}]{escape(m['status'])}[/]: "
                      + escape(f"{where} (by {m['requested_by'] or '-'}: {m['reason']})"))
        for st in m["steps"]:
            console.print(escape(f"  {str(st['time'])[11:19]} {st['step']}" + (f": {st['reason']}" if st["reason"] else "")))


def _explain_calls(d: Calls) -> None:
    """The policy calls: how many, how many failed, the time in policies, by policy."""
    if d["count"]:
        console.print(f"{d['count']} policy calls, {d['errors']} failed, {d['total_us'] / 1000:.2f} ms in policies:")
        for key, per in sorted(d["by_policy"].items()):
            console.print(escape(f"  {key}: {per['calls']} calls {per['actions']} {per['us'] / 1000:.2f} ms"))


def print_rejection(kind: str, env: Any) -> None:
    """A rejected create's every problem, one line each (its JSON path, what is wrong)."""
    from .client import event_data

    errors = event_data(env).get("errors") if kind == "rejected" else None
    for e in errors if isinstance(errors, list) else []:
        if isinstance(e, dict):
            err.print(f"[red]rejected[/] {escape(str(e.get('path')))}: {escape(str(e.get('message')))}")
