"""``blocks vcluster``: virtual clusters (seed 003) from the command line, and the client calls
behind it: publish a request, follow its outcome (``vcluster.changed`` or ``vcluster.refused``),
read the records and describe one as a tree (primary -> divisible -> job clusters).

Exit codes as everywhere: 0 done, 1 refused (or unknown), 2 bad input, 5 no outcome in time.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import typer
from rich.markup import escape

from .common import _json_option, _request, console, err
from .render import _plain, _print_json, _table

if TYPE_CHECKING:  # the rest is imported when a command runs: `blocks` starts with typer and rich only
    from ..schemas.records import JSONObject
    from ..schemas.vcluster import VClusterRecord
    from .client import Client


@dataclass(frozen=True)
class VRequest:
    vid: str
    op: str
    request_id: str
    seq: int


def _checked(ids: dict[str, str], replica_sets: Any, limits: Any, revision: int | None = None) -> None:
    """Every problem of a request's arguments at once, as one ValueError (exit 2): the ids
    (``{what: value}``), the revision, ``--replica-sets`` and ``--limits``."""
    from ..schemas.spec import check_id
    from ..schemas.vcluster import limit_problems, replica_set_problems

    problems = []
    for what, value in ids.items():
        try:
            check_id(value, what)
        except ValueError as exc:
            problems.append(str(exc))
    if revision is not None and revision < 1:
        problems.append(f"--revision must be >= 1, got {revision}")
    problems += [f"--replica-sets: {p}" for p in replica_set_problems(replica_sets)]
    if limits:
        problems += [f"--limits: {p}" for p in limit_problems(limits, replica_sets)]
    if problems:
        raise ValueError("; ".join(problems))


async def create(c: Client, vid: str, cid: str, replica_sets: Any, divisible: bool = False, limits: Any = None) -> VRequest:
    from ..bus.catalog import E
    from ..schemas.vcluster import VClusterCreate

    _checked({"virtual cluster id": vid, "cluster id": cid}, replica_sets, limits)
    rid = uuid.uuid4().hex[:12]
    ack = await c.bus.emit(E.vcluster_create, VClusterCreate(vid, cid, dict(replica_sets), rid, divisible, dict(limits or {})))
    return VRequest(vid, "create", rid, ack.seq)


async def update(c: Client, vid: str, revision: int, replica_sets: Any, divisible: bool | None = None,
                 limits: Any = None) -> VRequest:
    from ..bus.catalog import E
    from ..schemas.vcluster import VClusterUpdate

    _checked({"virtual cluster id": vid}, replica_sets, limits, revision)
    rid = uuid.uuid4().hex[:12]
    lim = dict(limits) if limits is not None else None
    ack = await c.bus.emit(E.vcluster_update, VClusterUpdate(vid, revision, dict(replica_sets), rid, divisible, lim))
    return VRequest(vid, "update", rid, ack.seq)


async def remove(c: Client, vid: str) -> VRequest:
    from ..bus.catalog import E
    from ..schemas.spec import check_id
    from ..schemas.vcluster import VClusterRemove

    check_id(vid, "virtual cluster id")
    rid = uuid.uuid4().hex[:12]
    ack = await c.bus.emit(E.vcluster_remove, VClusterRemove(vid, rid))
    return VRequest(vid, "remove", rid, ack.seq)


async def outcome(c: Client, req: VRequest, timeout: float = 60.0) -> tuple[bool, JSONObject]:
    """(applied, the ``changed`` or ``refused`` event's data) of a request; TimeoutError."""
    import asyncio

    import msgspec
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from .client import _ordered

    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await queue.put(msg)

    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=req.seq)
    sub = await _ordered(c.bus, f"aios.vcluster.{req.vid}.>", config, cb)
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await queue.get()
                kind = msg.subject.rsplit(".", 1)[1]
                data = msgspec.json.decode(msg.data).get("data") or {}
                if kind in ("changed", "refused") and data.get("request_id") == req.request_id:
                    return kind == "changed", data
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


class DescribedNode(TypedDict):
    type: str
    healthy: bool
    #: the virtual cluster it is placed in ("": the primary; "?": no view of it)
    place: str
    idle: bool


class DescribedVCluster(TypedDict):
    """A virtual cluster as ``vcluster get`` shows it (``describe``), its job clusters the same way."""

    id: str
    cluster: str
    kind: str
    revision: int
    replicaSets: dict[str, int]
    counts: dict[str, int]
    nodes: dict[str, DescribedNode]
    parent: str
    block: str
    limits: dict[str, list[int]]
    blocks: list[str]
    jobClusters: list[DescribedVCluster]


class DescribedPrimary(TypedDict):
    cluster: str
    #: node type -> how many no virtual cluster holds
    unassigned: dict[str, int]
    nodes: int


class Described(TypedDict):
    """``vcluster get``'s document (``--json`` prints it)."""

    primary: DescribedPrimary
    vcluster: DescribedVCluster


async def records(c: Client) -> list[VClusterRecord]:
    from ..schemas.vcluster import VClusterKind
    from ..state.vcluster import VClusterStore

    vs = VClusterStore(c.store)
    out: list[VClusterRecord] = []
    for cid in sorted(set((await vs.index()).values())):
        out += (await vs.records(cid)).values()
    return sorted(out, key=lambda r: (r.cluster, r.parent or r.id, r.kind == VClusterKind.JOB, r.id))


async def describe(c: Client, vid: str) -> Described:
    """The virtual cluster as a tree: its primary (the cluster and its unassigned nodes by type),
    itself (kind, revision, replica sets, nodes with type/health/place, blocks running inside) and
    its job clusters, the same way (LookupError: no such virtual cluster)."""
    from ..handlers.vcluster import idle, place
    from ..schemas.spec import check_id
    from ..schemas.vcluster import node_type
    from ..state.vcluster import VClusterStore

    check_id(vid, "virtual cluster id")
    vs = VClusterStore(c.store)
    cid = await vs.cluster_of(vid)
    recs = await vs.records(cid) if cid else {}
    if cid is None or vid not in recs:
        raise LookupError(f"no virtual cluster {vid!r}")
    views = await c.store.read_nodes(cid, await c.store.node_ids(cid))
    unassigned: dict[str, int] = {}
    for v in views.values():
        if not place(v):
            unassigned[node_type(v)] = unassigned.get(node_type(v), 0) + 1

    async def one(rec: VClusterRecord) -> DescribedVCluster:
        nodes: dict[str, DescribedNode] = {}
        counts: dict[str, int] = {}
        blocks: set[str] = set()
        for nid in sorted(rec.nodes):
            v = views.get(nid)
            t = rec.nodes[nid]
            counts[t] = counts.get(t, 0) + 1
            nodes[nid] = {"type": t, "healthy": bool(v and v["healthy"]), "place": place(v) if v else "?",
                          "idle": bool(v and idle(v))}
            if v and place(v) == rec.id:
                blocks |= {i["block_id"] for i in (await c.store.node_instances(nid)).values()}
        return {
            "id": rec.id, "cluster": rec.cluster, "kind": rec.kind.value, "revision": rec.revision,
            "replicaSets": rec.replica_sets, "counts": counts, "nodes": nodes, "parent": rec.parent, "block": rec.block,
            "limits": {t: list(mm) for t, mm in (rec.limits or {}).items()}, "blocks": sorted(blocks),
            "jobClusters": [await one(j) for j in sorted(recs.values(), key=lambda r: r.id) if j.parent == rec.id],
        }

    return {"primary": {"cluster": cid, "unassigned": unassigned, "nodes": len(views)}, "vcluster": await one(recs[vid])}


# -- the typer sub-app ------------------------------------------------------------------------------


def _follow(make: Any, timeout: float, data_dir: Path, as_json: bool = False) -> None:
    async def go(c: Client) -> int:
        req = await make(c)
        try:
            ok, data = await outcome(c, req, timeout)
        except TimeoutError:
            err.print(f"[red]no outcome after {timeout:g}s[/]; see: blocks vcluster get {req.vid}")
            return 5
        if as_json:
            _print_json({"applied": ok, **data})
            return 0 if ok else 1
        if not ok:
            err.print(f"[red]{req.op} of {req.vid} refused[/]: {escape(str(data.get('reason')))}"
                        + (f" (revision {data['revision']})" if data.get("revision") else ""))
            return 1
        rec, moved = data.get("record"), data.get("moved")
        nodes = rec.get("nodes") if isinstance(rec, dict) else None
        console.print(f"[green]{req.op} of {req.vid} done[/]: revision {data.get('revision')}, "
                        f"{len(nodes) if isinstance(nodes, dict) else 0} nodes ({len(moved) if isinstance(moved, dict) else 0} moved)")
        return 0

    code = int(_request(go, data_dir))
    if code:
        raise typer.Exit(code)


ReplicaSets = typer.Option(..., "--replica-sets", help='Node type -> count, as JSON: \'{"A100": 2}\'.')
Timeout = typer.Option(60.0, "--timeout", help="Give up waiting for the outcome after this many seconds (exit 5).")
AsJson = typer.Option(False, "--json")
Limits = typer.Option(None, "--limits", help='Autoscaling per node type, [min, max] as JSON: \'{"A100": [1, 4]}\'.')


def register(parent: typer.Typer, DataDir: Any) -> None:
    """Add ``blocks vcluster ...`` to the CLI (``DataDir``: its ``--data-dir`` option)."""
    app = typer.Typer(help="Virtual clusters (seed 003): create, update, remove, list, get.", no_args_is_help=True)
    parent.add_typer(app, name="vcluster")

    @app.command("create")
    def create_cmd(
        vcluster_id: str,
        cluster: str = typer.Option(..., "--cluster", "-c", help="The cluster (primary) whose unassigned nodes it takes."),
        divisible: bool = typer.Option(False, "--divisible", help="Divisible: job clusters are carved from it."),
        replica_sets: str = ReplicaSets,
        limits: str = Limits,
        timeout: float = Timeout,
        as_json: bool = AsJson,
        data_dir: Path = DataDir,
    ) -> None:
        """Create a virtual cluster from idle unassigned nodes of a cluster.

        Example: `blocks vcluster create team-a --cluster c1 --replica-sets '{"A100": 2}'`
        """
        rs = _json_option(replica_sets, "--replica-sets")
        lim = _json_option(limits, "--limits") if limits else None
        _follow(lambda c: create(c, vcluster_id, cluster, rs, divisible, lim), timeout, data_dir, as_json)


    @app.command("update")
    def update_cmd(
        vcluster_id: str,
        revision: int = typer.Option(..., "--revision", "-r", help="Its latest revision (blocks vcluster get)."),
        replica_sets: str = ReplicaSets,
        divisible: bool = typer.Option(None, "--divisible/--indivisible", help="Only to check it (a kind cannot change)."),
        limits: str = Limits,
        timeout: float = Timeout,
        as_json: bool = AsJson,
        data_dir: Path = DataDir,
    ) -> None:
        """Change a virtual cluster's replica sets (scale up from the primary, down by idle nodes).

        Example: `blocks vcluster update team-a --revision 1 --replica-sets '{"A100": 3}'`
        """
        rs = _json_option(replica_sets, "--replica-sets")
        lim = _json_option(limits, "--limits") if limits else None
        _follow(lambda c: update(c, vcluster_id, revision, rs, divisible, lim), timeout, data_dir, as_json)


    @app.command("remove")
    def remove_cmd(
        vcluster_id: str, timeout: float = Timeout, as_json: bool = AsJson,
        data_dir: Path = DataDir,
    ) -> None:
        """Remove an empty virtual cluster: its nodes go back to the primary.

        Example: `blocks vcluster remove team-a`
        """
        _follow(lambda c: remove(c, vcluster_id), timeout, data_dir, as_json)


    @app.command("list")
    def list_cmd(as_json: bool = AsJson, data_dir: Path = DataDir) -> None:
        """Every virtual cluster: cluster, kind, revision, replica sets, nodes.

        Example: `blocks vcluster list`, `blocks vcluster list --json`
        """
        import msgspec

        recs = _request(records, data_dir, store_only=True)
        if as_json:
            _print_json([msgspec.to_builtins(r) for r in recs])
            return
        t = _table("virtual cluster", "cluster", "kind", "revision", "replica sets", "nodes", "parent / block")
        for r in recs:
            t.add_row(*_plain(r.id, r.cluster, r.kind.value, r.revision, json.dumps(r.replica_sets), len(r.nodes),
                                " / ".join(x for x in (r.parent, r.block) if x) or "-"))
        console.print(t)


    @app.command("get")
    def get_cmd(vcluster_id: str, as_json: bool = AsJson, data_dir: Path = DataDir) -> None:
        """One virtual cluster as a tree: primary -> it -> its job clusters (node types, counts,
        revision, blocks running inside).

        Example: `blocks vcluster get team-a`, `blocks vcluster get team-a --json`
        """
        from rich.tree import Tree

        d = _request(lambda c: describe(c, vcluster_id), data_dir, store_only=True)
        if as_json:
            _print_json(d)
            return
        p = d["primary"]
        tree = Tree(f"[bold]{p['cluster']}[/] (primary): {p['nodes']} nodes, unassigned {json.dumps(p['unassigned'])}")

        def add(node: Tree, v: DescribedVCluster) -> None:
            head = (f"[bold]{v['id']}[/] {v['kind']} revision {v['revision']}: {json.dumps(v['counts'])} "
                    f"of {json.dumps(v['replicaSets'])}" + (f", limits {escape(json.dumps(v['limits']))}" if v.get("limits") else ""))
            if v["block"]:
                head += f", block {v['block']}"
            branch = node.add(head)
            for nid, n in v["nodes"].items():
                state = "alive" if n["healthy"] else "[red]dead[/]"
                where = "" if n["place"] == v["id"] else f" (in {n['place'] or 'the primary'})"
                branch.add(f"{nid} {n['type']} {state}{'' if n['idle'] else ' busy'}{where}")
            if v["blocks"]:
                branch.add("blocks inside: " + ", ".join(v["blocks"]))
            for j in v["jobClusters"]:
                add(branch, j)

        add(tree, d["vcluster"])
        console.print(tree, soft_wrap=False)  # a long line wraps under its branch (soft wrap cut it at the width)
