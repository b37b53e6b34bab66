"""The contended-cluster commands (issue 36, docs/priority.md): ``priority-class add|list|remove``
and ``quota set|get|list``. Each change is an event first (the stream is what ``blocks recover``
rebuilds Redis from), then a write to Redis so the next command sees it at once."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from .common import DataDir, _one_line, _request, console, err
from .render import _plain, _print_json, _table

if TYPE_CHECKING:
    from ..policies.quota import QuotaRow
    from .client import Client


def _op_id() -> str:
    return uuid.uuid4().hex


# -- priority classes ------------------------------------------------------------------------------
def priority_class_add(
    name: str = typer.Argument(..., help="The class's name (blocks name it as priorityClass)."),
    value: int = typer.Argument(..., help="Its priority: higher preempts lower by AIOS_PREEMPT_MIN_DELTA points or more."),
    default: bool = typer.Option(False, "--default", help="The class of blocks that name none (the previous default stops being it)."),
    description: str = typer.Option("", "--description", help="What the class is for."),
    data_dir: Path = DataDir,
) -> None:
    """Register (or replace) a priority class.

    Example: `blocks priority-class add high 1000 --description "latency-sensitive serving"`,
    `blocks priority-class add normal 100 --default`; a negative value after `--` (options before
    it): `blocks priority-class add scavenger --description spare -- -10`
    """
    from ..bus.catalog import E
    from ..schemas.priority import PriorityClass, PriorityClassRegistered
    from ..state.priority import PriorityStore

    try:
        pc = PriorityClass(name=name, value=value, default=default, description=description)
    except ValueError as exc:  # pydantic's problems, every one, on one line
        err.print(f"[red]error:[/] {escape(_one_line(exc))}")
        raise typer.Exit(2)

    async def go(c: Client) -> None:
        record = pc.model_dump(mode="json")
        await c.bus.emit(E.priority_class_registered, PriorityClassRegistered(name, record), msg_id=f"priorityclass:{_op_id()}")
        await PriorityStore(c.store.r).put_class(record)

    _request(go, data_dir)
    console.print(f"priority class [bold]{name}[/] = {value}" + (" (the default)" if default else ""))


def priority_class_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """List the priority classes, highest first.

    Example: `blocks priority-class list`
    """
    from ..state.priority import PriorityStore

    classes = _request(lambda c: PriorityStore(c.store.r).classes(), data_dir, store_only=True)
    rows = sorted(classes.values(), key=lambda c: (-int(c["value"]), c["name"]))
    if as_json:
        _print_json(rows)
        return
    t = _table("class", "value", "default", "description")
    for c in rows:
        t.add_row(*_plain(c["name"], c["value"], "yes" if c.get("default") else "", c.get("description", "")))
    console.print(t)


def priority_class_remove(name: str, data_dir: Path = DataDir) -> None:
    """Remove a priority class (blocks already parsed keep the value their IR holds).

    Example: `blocks priority-class remove batch`
    """
    from ..bus.catalog import E
    from ..schemas.priority import PriorityClassRemoved
    from ..state.priority import PriorityStore

    async def go(c: Client) -> None:
        store = PriorityStore(c.store.r)
        if name not in await store.classes():
            raise LookupError(f"no priority class {name!r}")
        op = _op_id()
        await c.bus.emit(E.priority_class_removed, PriorityClassRemoved(name, op), msg_id=f"priorityclass:{op}")
        await store.remove_class(name)

    _request(go, data_dir)
    console.print(f"priority class [bold]{name}[/] removed")


# -- quotas ----------------------------------------------------------------------------------------
def _amounts(values: list[str], option: str, problems: list[str]) -> dict[str, dict[str, float]]:
    """``MODEL:RES=N[,RES=N]`` (repeatable) -> model -> resource -> amount; each value that is not
    that goes to ``problems`` (all of them, not the first)."""
    out: dict[str, dict[str, float]] = {}
    for v in values:
        model, sep, rest = v.partition(":")
        if not sep or not model:
            problems.append(f"{option}: {v!r} is not MODEL:RESOURCE=N[,RESOURCE=N] (MODEL * for any)")
            continue
        for pair in rest.split(","):
            res, eq, num = pair.partition("=")
            try:
                amount = float(num)
            except ValueError:
                amount = math.nan
            if not eq or not math.isfinite(amount):
                problems.append(f"{option}: {pair!r} is not RESOURCE=N")
                continue
            out.setdefault(model, {})[res.strip()] = amount
    return out


def quota_set(
    tenant: str = typer.Argument(..., help="The tenant: a block's `tenant` label, or its virtual cluster id."),
    nominal: list[str] = typer.Option([], "--nominal", help="MODEL:RES=N[,RES=N] (repeat; MODEL * = any model; RES gpus, gpuShare, cpu, memory)."),
    cohort: str = typer.Option(None, "--cohort", help="Tenants of one cohort lend each other what they leave idle."),
    borrowing_limit: list[str] = typer.Option([], "--borrowing-limit", help="Most it may borrow above nominal, as --nominal."),
    remove: bool = typer.Option(False, "--remove", help="Remove the tenant's quota."),
    data_dir: Path = DataDir,
) -> None:
    """Set (replace) a tenant's quota: nominal amounts per GPU model, its cohort, a borrowing limit.
    `--remove` of a tenant without a quota is refused (exit 1).

    Example: `blocks quota set team-a --nominal A100:gpus=16,cpu=256 --cohort lab`,
    `blocks quota set team-b --nominal '*:gpus=8' --cohort lab --borrowing-limit '*:gpus=4'`
    """
    from pydantic import ValidationError

    from ..bus.catalog import E
    from ..schemas.priority import Quota, QuotaSet
    from ..state.priority import PriorityStore

    record: dict[str, Any] | None = None
    if not remove:
        problems: list[str] = []  # every one, the values' and the quota's, at once
        amounts = _amounts(nominal, "--nominal", problems)
        limit = _amounts(borrowing_limit, "--borrowing-limit", problems) if borrowing_limit else None
        try:
            record = Quota(tenant=tenant, cohort=cohort, nominal=amounts, borrowingLimit=limit).model_dump(mode="json")
        except ValidationError as exc:
            problems += [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                         for e in exc.errors(include_url=False)]
        for line in problems:
            err.print(f"[red]error:[/] {escape(line)}")
        if problems:
            raise typer.Exit(2)

    async def go(c: Client) -> None:
        if remove and tenant not in await PriorityStore(c.store.r).quota_tenants():  # an unreadable one too
            raise LookupError(f"no quota for tenant {tenant!r}")  # as quota get: exit 1, nothing stored
        await c.bus.emit(E.quota_set, QuotaSet(tenant, record), msg_id=f"quota:{_op_id()}")
        await PriorityStore(c.store.r).put_quota(record, tenant)

    _request(go, data_dir)
    console.print(f"quota of [bold]{tenant}[/] " + ("removed" if remove else "set"))


async def _report(c: Any, recount: bool = False) -> tuple[dict[str, Any], list[QuotaRow], list[dict[str, Any]]]:
    """The quotas, the rows of usage vs nominal vs borrowed from the usage counters the capacity
    scripts keep (one read per cluster, as the quota gate reads them), and with ``recount`` where
    a recount of the placed blocks (every block's instances: a scan) differs from them."""
    from ..policies import quota as qp
    from ..schemas.priority import Quota
    from ..state.priority import PriorityStore

    store = PriorityStore(c.store.r)
    quotas = {t: Quota.model_validate(q) for t, q in (await store.quotas()).items()}
    counted = qp.from_fields(await store.usage_counters())
    rows = qp.report(quotas, [qp.Holding(f"{qp.TOTAL}{t}", t, u) for t, u in sorted(counted.items())])
    diffs: list[dict[str, Any]] = []
    if recount:
        placed, models = await store.placed()
        diffs = differences(counted, qp.usage_by_tenant(qp.holdings_of(placed, models)))
    return {t: q.model_dump(mode="json") for t, q in quotas.items()}, rows, diffs


def differences(counted: dict[str, Any], recounted: dict[str, Any]) -> list[dict[str, Any]]:
    """(tenant, model, resource) where the counters and the recount differ (by more than 1e-6)."""
    out = []
    for tenant in sorted(set(counted) | set(recounted)):
        a, b = counted.get(tenant, {}), recounted.get(tenant, {})
        for model in sorted(set(a) | set(b)):
            for res in sorted(set(a.get(model, {})) | set(b.get(model, {}))):
                x, y = a.get(model, {}).get(res, 0.0), b.get(model, {}).get(res, 0.0)
                if abs(x - y) > 1e-6:
                    out.append({"tenant": tenant, "model": model, "resource": res, "counters": round(x, 6),
                                "recount": round(y, 6)})
    return out


def _fmt(amounts: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(amounts.items())) or "-"


def _print_rows(rows: list[QuotaRow]) -> None:
    t = _table("tenant", "cohort", "model", "usage", "nominal", "borrowed")
    for r in rows:
        t.add_row(*_plain(r["tenant"], r["cohort"], r["model"], _fmt(r["usage"]), _fmt(r["nominal"]), _fmt(r["borrowed"])))
    console.print(t)


def quota_list(
    as_json: bool = typer.Option(False, "--json"),
    recount: bool = typer.Option(False, "--recount", help="Also recount the usage from every placed block (a scan) and "
                                 "compare it with the counters: each difference listed, exit 1 when there is one."),
    data_dir: Path = DataDir,
) -> None:
    """Every tenant's usage vs nominal vs borrowed, per GPU model (the usage counters the quota
    gate reads, kept with every reservation taken or given back).

    Example: `blocks quota list`, `blocks quota list --json`, `blocks quota list --recount`
    """
    _, rows, diffs = _request(lambda c: _report(c, recount), data_dir, store_only=True)
    if as_json:
        _print_json({"rows": rows, "differences": diffs} if recount else rows)
    else:
        _print_rows(rows)
        if recount and diffs:
            t = _table("tenant", "model", "resource", "counters", "recount")
            for d in diffs:
                t.add_row(*_plain(d["tenant"], d["model"], d["resource"], f"{d['counters']:g}", f"{d['recount']:g}"))
            console.print("[red]the usage counters differ from a recount of the placed blocks[/] (blocks recover rebuilds them):")
            console.print(t)
        elif recount:
            console.print("the usage counters equal a recount of the placed blocks")
    if diffs:
        raise typer.Exit(1)


def quota_get(tenant: str, as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """One tenant's quota and its usage vs nominal vs borrowed (from the usage counters).

    Example: `blocks quota get team-a`
    """
    quotas, rows, _ = _request(_report, data_dir, store_only=True)
    if tenant not in quotas:
        err.print(f"[red]no quota for tenant {tenant!r}[/]")
        raise typer.Exit(1)
    mine = [r for r in rows if r["tenant"] == tenant]
    if as_json:
        _print_json({"quota": quotas[tenant], "usage": mine})
        return
    q = quotas[tenant]
    console.print(f"tenant [bold]{tenant}[/] cohort {q.get('cohort') or '-'}"
                  + (f", borrowing limit {q['borrowingLimit']}" if q.get("borrowingLimit") else ""))
    _print_rows(mine)


def gpu_memory_freed(output: Mapping[str, Any], by_block: Mapping[str, Mapping[str, Any]]) -> float:
    """MiB of GPU memory the plan's victims free (each instance's ``gpuMemory`` on each of its
    GPUs): what a need whose ``gpuMemory`` binds is placed on, where ``gpus_freed`` counts compute."""
    return sum(len(inst.get("gpus") or ()) * float(inst.get("gpuMemory") or 0)
               for bid, iids in (output.get("blocks") or {}).items() for i in iids
               for inst in [by_block[bid]["instances"][i]])


# -- preemption, dry run ---------------------------------------------------------------------------
def preempt(
    spec_file: Path = typer.Argument(..., help="The block spec (YAML/JSON) that would be placed."),
    cluster: str = typer.Option(..., "--cluster", help="The cluster to plan in."),
    policy_uri: str = typer.Option("builtin:preempt-min", "--policy", help="The preemption policy (a policyRuleURI)."),
    dry_run: bool = typer.Option(True, "--dry-run/--no-dry-run", help="Only a dry run exists today: nothing is evicted."),
    as_json: bool = typer.Option(False, "--json", help="The policy's input and output as JSON."),
    data_dir: Path = DataDir,
) -> None:
    """Which blocks a spec would preempt in a cluster now (like `nomad job plan`): the victims per
    node, or why there are none, and what its tenant's quota says (admit, admit-borrowing,
    reclaim, wait). Changes nothing. Exit 0 planned, 1 an unknown cluster or the policy failed (with
    --json too: the output's "error" says why), 2 bad input: options or a rejected spec (as `blocks
    submit --dry-run`).

    Example: `blocks preempt --dry-run urgent.yaml --cluster c1`
    """
    from ..handlers import parse
    from ..handlers.preemption import preempt_input
    from ..policies.quota import decide, holdings_of, request_usage, tenant_of
    from ..policies.runtime import PolicyRuntime
    from ..schemas.errors import PolicyFailed
    from ..schemas.priority import Quota
    from ..settings import load as load_settings
    from ..state.priority import PriorityStore
    from .common import _load

    if not dry_run:
        err.print("[red]only --dry-run exists today[/]: the controller preempts by itself (docs/priority.md)")
        raise typer.Exit(2)
    doc = _load(spec_file)
    settings = load_settings()

    async def go(c: Any) -> tuple[dict[str, Any], Any, dict[str, Any]] | list[Any]:
        store = PriorityStore(c.store.r)
        uri = parse.component_uri(doc)
        component = await c.store.get_component(uri) if uri else None
        bid = str(doc.get("blockId") or "dry-run")
        out = parse.build({**doc, "blockId": bid}, component, bid, None, settings, await store.classes())
        if out.ir is None:
            return out.errors
        views = await c.store.read_nodes(cluster, await c.store.node_ids(cluster))
        if not views:
            raise LookupError(f"no cluster {cluster!r} (or it has no nodes)")
        placed, models = await store.placed()
        data = preempt_input(bid, out.ir, cluster, views, placed, settings.preempt_min_delta)
        quotas = {t: Quota.model_validate(q) for t, q in (await store.quotas()).items()}
        tenant = tenant_of(out.ir)
        request = request_usage(out.ir.get("resources") or {}, max(1, int(out.ir.get("minInstances") or 0)))
        d = decide(tenant, request, quotas, holdings_of(placed, models))
        quota = {"tenant": tenant, "verdict": str(d.verdict), "reason": d.reason, "borrowed": d.borrowed,
                 "victims": d.victims, "victim_reason": d.victim_reason}
        rule = {"name": "preemption", "policyRuleURI": policy_uri}
        try:
            return data, await PolicyRuntime(lookup=c.store.policy_get).invoke(rule, "cli.preempt", data, {}), quota
        except PolicyFailed as exc:
            return data, {"error": str(exc)}, quota

    result = _request(go, data_dir, store_only=True)
    if isinstance(result, list):
        for e in result:
            err.print(f"[red]rejected[/] {escape(e.path)}: {escape(e.message)}")
        raise typer.Exit(2)  # bad input, as `submit --dry-run` says it
    data, output, quota = result
    if as_json:
        _print_json({"input": data, "output": output, "quota": quota})
        if "error" in output:  # the policy failed: its "error" says why
            raise typer.Exit(1)
        return
    if "error" in output:
        err.print(f"[red]{escape(output['error'])}[/]")
        raise typer.Exit(1)
    block = data["block"]
    console.print(f"block at priority {block['priority']} ({block.get('priorityClass') or 'no class'}), "
                  f"{max(1, block['minInstances'])} instance(s): {output.get('reason', '')}")
    if output["victims"]:
        by_block = {c["block_id"]: c for c in data["candidates"]}
        t = _table("victim block", "priority", "instances", "nodes")
        for bid, iids in sorted((output.get("blocks") or {}).items()):
            nodes = sorted({by_block[bid]["instances"][i]["node_id"] for i in iids})
            t.add_row(*_plain(bid, by_block[bid]["priority"], ", ".join(iids), ", ".join(nodes)))
        console.print(t)
        mib = gpu_memory_freed(output, by_block)
        console.print(f"GPUs freed: {output.get('gpus_freed', 0):g}" + (f", GPU memory freed: {mib / 1024:g} GiB" if mib else "")
                      + f"; then placed on {output.get('fits')}")
    console.print(f"quota of tenant {quota['tenant'] or '-'}: {quota['verdict']} ({quota['reason']})"
                  + (f"; may reclaim {', '.join(quota['victims'])} ({quota['victim_reason']})" if quota["victims"] else ""))
