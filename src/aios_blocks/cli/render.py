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

    from .client import Client

def _plain(*values: Any) -> list[str]:
    """Table cells of data (ids, reasons, labels, a user's strings): shown as they are, never read
    as Rich markup (``x[ocr]y`` stays ``x[ocr]y``)."""
    return [escape(str(v)) for v in values]


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
    elif kind == "submitted":  # the create, as the parser stored it (its publisher may have sent a bare spec)
        spec: dict[str, Any] = data["spec"] if isinstance(data.get("spec"), dict) else {}
        detail = (f"gen={data.get('gen')} {'CloudEvent' if data.get('framing') == 'cloudevent' else 'bare spec'} "
                  f"on {data.get('subject')}" + (f" component={spec['blockComponentURI']}" if spec.get("blockComponentURI") else "")
                  + ("" if spec else " (no spec in its body)"))
    elif kind in ("ready", "failed", "deleted"):
        detail = data.get("reason") or f"instances={data.get('instances')}"
    elif kind == "rejected":
        detail = "; ".join(f"{e['path']}: {e['message']}" for e in data.get("errors", []))
    elif kind.endswith("failed"):
        detail = data.get("reason", "")
    elif kind == "decision":
        detail = _call(data)
    elif kind == "scale.target":  # (the row was bare: what count, asked by whom and why)
        detail = f"target={data.get('target')} by {data.get('source') or '-'}" + (f": {data['reason']}" if data.get("reason") else "")
    elif kind == "scale_down.chosen":
        detail = f"{data.get('instance_id')}@{data.get('node_id')} chosen by {data.get('chosen_by') or '-'}" + (
            f": {data['reason']}" if data.get("reason") else "")
    elif kind.startswith("instance."):
        detail = f"node={data.get('node_id')} gpus={data.get('gpus')}" + (f" reason={data['reason']}" if data.get("reason") else "")
        if data.get("endpoint"):
            detail += f" at {data['endpoint']}"
    if kind != "decision":
        for call in data.get("decisions") or []:
            detail += "\n    policy " + _call(call)
    colour = {"ready": "green", "failed": "red", "rejected": "red", "deleted": "yellow"}.get(kind.rsplit(".", 1)[-1], "cyan")
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
    reason, errors = block.get("reason") or "", _spec_errors(block.get("reason"))
    title = escape(f"block {bid}: {block['status']}" + (f" ({reason})" if reason and errors is None else ""))
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


def _spec_errors(reason: Any) -> list[dict[str, Any]] | None:
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
        why = f": {tg['reason']}" if tg.get("reason") else ""  # (`blocks scale --to` gives none)
        console.print(escape(f"instance target {tg['target']} asked by {tg['source']} {str(tg['time'])[11:19]}{why}"))
    d = x["decisions"]
    if d["count"]:
        console.print(f"{d['count']} policy calls, {d['errors']} failed, {d['total_us'] / 1000:.2f} ms in policies:")
        for key, per in sorted(d["by_policy"].items()):
            console.print(escape(f"  {key}: {per['calls']} calls {per['actions']} {per['us'] / 1000:.2f} ms"))
