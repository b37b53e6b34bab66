"""The inventory commands: ``component add|list``, ``cluster add|list``, ``node add|list`` (drain,
undrain and remove are in ``cli/nodes.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from .common import DataDir, _labels, _load, _request, _run, _with_client, _with_store, console, err
from .render import _plain, _print_json, _table

if TYPE_CHECKING:
    from typing import TypedDict

    from ..schemas.records import NodeView
    from ..schemas.topology import GpuTopology
    from ..state.health import SuspectMark
    from ..state.store import ComponentRecord
    from .client import Client

    class ClusterRow(TypedDict):
        """One row of ``cluster list`` (``--json`` prints them)."""

        id: str
        labels: dict[str, str]
        nodes: int
        healthy_nodes: int
        gpus: int
        gpus_free: int

    class NodeRow(NodeView, total=False):
        """One row of ``node list``: the node's view, its mark when suspect and its type."""

        suspect: SuspectMark | None
        node_type: str

def component_add(file: Path, data_dir: Path = DataDir) -> None:
    """Register (or replace) a component from YAML/JSON.

    Example: `blocks component add examples/component.yaml` (from an installed wheel, `blocks
    examples --copy examples` writes the examples there first)
    """
    from pydantic import ValidationError

    from ..schemas.ir import pydantic_errors

    doc = _load(file)
    try:
        comp = _run(_with_client(data_dir, lambda c: c.add_component(doc)))
    except ValidationError as exc:
        for e in pydantic_errors(exc):
            err.print(f"[red]{e.path}[/]: {e.message}")
        raise typer.Exit(4)
    console.print(f"component [bold]{comp.componentURI}[/] registered")


def component_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """List registered components: URI, image, resources per instance, policies.

    Example: `blocks component list`, `blocks component list --json`
    """

    async def go(c: Client) -> dict[str, ComponentRecord]:
        return await c.store.components()

    comps = _run(_with_store(data_dir, go))
    if as_json:
        _print_json(comps)
        return
    t = _table("component", "image", "resources", "policies")
    for uri, comp in comps.items():
        res = comp.get("resources") or {}
        t.add_row(*_plain(uri, comp.get("image", ""), ", ".join(f"{k}={v}" for k, v in res.items()),
                          ", ".join(f"{p.get('name')}={p.get('policyRuleURI')}" for p in comp.get("policies") or [])))
    console.print(t)


def cluster_list(as_json: bool = typer.Option(False, "--json"), data_dir: Path = DataDir) -> None:
    """List clusters with their labels, node count and free GPUs.

    Example: `blocks cluster list`
    """

    async def go(c: Client) -> list[ClusterRow]:
        out: list[ClusterRow] = []
        for cid, cluster in sorted((await c.store.clusters()).items()):
            nodes = await c.store.read_nodes(cid, await c.store.node_ids(cid))
            gpus = [g for n in nodes.values() for g in n["gpus"]]
            out.append({"id": cid, "labels": cluster.get("labels", {}), "nodes": len(nodes),
                        "healthy_nodes": sum(1 for n in nodes.values() if n["healthy"]),
                        "gpus": len(gpus), "gpus_free": sum(1 for g in gpus if g["instances"] == 0)})
        return out

    rows = _run(_with_store(data_dir, go))
    if as_json:
        _print_json(rows)
        return
    t = _table("cluster", "labels", "nodes (healthy)", "GPUs free / total")
    for r in rows:
        t.add_row(*_plain(r["id"], ", ".join(f"{k}={v}" for k, v in r["labels"].items()), f"{r['nodes']} ({r['healthy_nodes']})",
                          f"{r['gpus_free']} / {r['gpus']}"))
    console.print(t)


def node_list(
    cluster: str = typer.Option(None, "--cluster", "-c", help="Only this cluster's nodes."),
    as_json: bool = typer.Option(False, "--json"),
    data_dir: Path = DataDir,
) -> None:
    """List nodes: cluster, node type (what virtual clusters' replica sets count: the `nodeType`
    label, else the first GPU's model), health (`suspect`: every instance on it fails its probes
    and its agent is silent, no placement goes there; docs/health.md), free CPU and memory, GPUs
    in use, labels. `--json` gives each node's `node_type` and `suspect` (its mark, or null) too.

    Example: `blocks node list --cluster c1`
    """

    async def go(c: Client) -> list[NodeRow]:
        cids = sorted(await c.store.clusters())
        if cluster is not None:
            if cluster not in cids:
                raise LookupError(f"no cluster {cluster!r} (known: {', '.join(cids) or 'none'})")
            cids = [cluster]
        out: list[NodeRow] = []
        for cid in cids:  # (the views as rows: the table adds ``suspect``)
            out += ({**v} for v in (await c.store.read_nodes(cid, await c.store.node_ids(cid))).values())
        suspect = await c.store.health.suspects()
        for n in out:
            n["suspect"] = suspect.get(n["node_id"])
        return out

    from ..schemas.vcluster import node_type

    nodes = _request(go, data_dir, store_only=True)
    for n in nodes:
        n["node_type"] = node_type(n)
    if as_json:
        _print_json(nodes)
        return
    t = _table("node", "cluster", "type", "healthy", "CPU free", "memory free (MiB)", "GPUs in use", "labels")
    for n in nodes:
        busy = sum(1 for g in n["gpus"] if g["instances"])
        health = ("[yellow]suspect[/]" if n["suspect"] else "yes") if n["healthy"] else "[red]no[/]"
        t.add_row(escape(n["node_id"]), escape(n["cluster"]), escape(n["node_type"]), health,
                  f"{n['cpu_free']:g} / {n['cpu']:g}", f"{n['memory_free']} / {n['memory']}", f"{busy} / {len(n['gpus'])}",
                  escape(", ".join(f"{k}={v}" for k, v in n["labels"].items())))
    console.print(t)


def cluster_add(
    cluster_id: str,
    label: list[str] = typer.Option([], "--label", "-l", help="key=value, repeatable."),
    nodes: int = typer.Option(None, min=1, help="Also add this many simulated nodes (at least 1)."),
    gpus: int | None = typer.Option(None, min=0, show_default=False, help="GPUs per simulated node (default 8)."),
    gpu_memory: int = typer.Option(81920, min=1, help="MiB per simulated GPU."),
    node_type: str = typer.Option(None, "--node-type", help="nodeType label of the simulated nodes (virtual clusters' replica sets)."),
    gpu_model: str = typer.Option(None, "--gpu-model", show_default=False,
                                  help="Model of the simulated GPUs (what resources.gpuModels matches); default: the --node-type, else sim-h100."),
    node_label: list[str] = typer.Option([], "--node-label", help="key=value on every simulated node, repeatable."),
    gpu_topology: str = typer.Option(None, "--gpu-topology", show_default=False,
                                     help="GPU topology profile of the simulated nodes (docs/topology.md): "
                                          "dgx-nvswitch-8, hybrid-cube-mesh-8, nvlink-pairs-4, pcie-pairs; sets --gpus."),
    data_dir: Path = DataDir,
) -> None:
    """Register a cluster, optionally with simulated nodes.

    Example: `blocks cluster add c1 -l region=eu --nodes 8 --gpus 8 --node-type A100`
    """
    labels = _labels(label)
    node_labels = _labels(node_label, "--node-label") | ({"nodeType": node_type} if node_type else {})
    from ..schemas.spec import Cluster, check_id

    check_id(cluster_id, "cluster id")
    topo = _topology(gpu_topology)
    count = _gpu_count(gpus, topo, gpu_topology)

    async def go(c: Client) -> None:
        if nodes:
            # (an "A100" node type whose GPUs said "sim-h100" puzzled a stranger: the type is the model unless told)
            await c.add_sim_cluster(cluster_id, nodes=nodes, gpus=count, gpu_memory=gpu_memory, labels=labels,
                                    node_labels=node_labels, model=gpu_model or node_type or "sim-h100", topology=topo)
        else:
            await c.add_cluster(Cluster(id=cluster_id, labels=labels))

    _run(_with_client(data_dir, go))
    console.print(f"cluster [bold]{cluster_id}[/] registered ({nodes or 0} simulated nodes)")


def node_add(
    node_id: str,
    cluster: str = typer.Option(..., "--cluster", "-c", help="A registered cluster (`blocks cluster list`; `blocks cluster add` makes one)."),
    gpus: int | None = typer.Option(None, min=0, show_default=False, help="GPUs (default 8)."),
    gpu_memory: int = typer.Option(81920, min=1, help="MiB per GPU."),
    gpu_model: str = typer.Option("sim-gpu"),
    cpu: float = typer.Option(64, min=0),
    memory: int = typer.Option(512 * 1024, min=1, help="MiB."),
    label: list[str] = typer.Option([], "--label", "-l", help="key=value, repeatable."),
    gpu_topology: str = typer.Option(None, "--gpu-topology", show_default=False,
                                     help="GPU topology profile (docs/topology.md): dgx-nvswitch-8, hybrid-cube-mesh-8, "
                                          "nvlink-pairs-4, pcie-pairs; sets --gpus to its GPU count. "
                                          "Also read from a `gpu-topology` label."),
    data_dir: Path = DataDir,
) -> None:
    """Register a (simulated) node in a registered cluster: a cluster that does not exist is
    refused (exit 1, naming the known ones): `blocks cluster add C` creates one (a typo made one).

    Example: `blocks node add n9 --cluster c1 --gpus 4 -l rack=2`;
    `blocks node add n10 --cluster c1 --gpu-topology hybrid-cube-mesh-8`
    """
    from ..schemas.spec import Gpu, Node, check_id

    check_id(node_id, "node id")
    check_id(cluster, "cluster id")
    labels = _labels(label)
    topo = _topology(gpu_topology or labels.get("gpu-topology"))  # the option, or the label of that name
    count = _gpu_count(gpus, topo, gpu_topology or labels.get("gpu-topology"))
    node = Node(
        id=node_id, cluster=cluster, cpu=cpu, memory=memory, labels=labels,
        gpus=[Gpu(id=f"{node_id}-g{i}", model=gpu_model, memory=gpu_memory) for i in range(count)], topology=topo,
    )
    _request(lambda c: c.add_node(node, cluster_must_exist=True), data_dir)
    console.print(f"node [bold]{node_id}[/] registered in {cluster}")


def _topology(name: str | None) -> GpuTopology | None:
    """A ``--gpu-topology`` profile (None: not given); an unknown name exits 2 naming the known ones."""
    if not name:
        return None
    from ..schemas.topology import profile

    try:
        return profile(name)
    except ValueError as exc:
        err.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2)


def _gpu_count(gpus: int | None, topo: GpuTopology | None, name: str | None) -> int:
    """The GPUs of a simulated node: the topology profile's count, else ``--gpus`` (8 when neither);
    a ``--gpus`` the profile contradicts exits 2 (it was dropped for the profile's, unsaid)."""
    if topo is None:
        return 8 if gpus is None else gpus
    if gpus is not None and gpus != topo.gpus:
        err.print(f"[red]error:[/] --gpus {gpus} but the GPU topology {escape(str(name))} has {topo.gpus} GPUs: "
                  "give one of them, or the same count")
        raise typer.Exit(2)
    return topo.gpus


def node_get(
    node_id: str,
    as_json: bool = typer.Option(False, "--json", help="Print the node as JSON (its view, with `topology`)."),
    data_dir: Path = DataDir,
) -> None:
    """Show one node: capacity, GPUs and, when it reports one, its GPU topology (docs/topology.md):
    the profile or source and each GPU pair's link tier, as `nvidia-smi topo -m` prints it.

    Example: `blocks node get c1-n0`
    """

    async def go(c: Client) -> NodeView:
        cid = await c.store.node_cluster(node_id)
        views = await c.store.read_nodes(cid, [node_id]) if cid else {}
        if node_id not in views:
            raise LookupError(f"no node {node_id!r}")
        return views[node_id]

    node = _request(go, data_dir, store_only=True)
    if as_json:
        _print_json(node)
        return
    console.print(f"node [bold]{escape(node['node_id'])}[/] in {escape(node['cluster'])}: "
                  f"CPU {node['cpu_free']:g} / {node['cpu']:g} free, memory {node['memory_free']} / {node['memory']} MiB free")
    t = _table("GPU", "id", "model", "memory free (MiB)", "instances")
    for i, g in enumerate(node["gpus"]):
        t.add_row(str(i), *_plain(g["id"], g["model"], f"{g['memory_free']} / {g['memory']}", str(g["instances"])))
    console.print(t)
    topo = node.get("topology")
    if not topo:
        console.print("GPU topology: unknown (the node reports none)")
        return
    from ..schemas.topology import GpuTopology

    parsed = GpuTopology.model_validate(topo)
    where = f"profile {parsed.profile}" if parsed.profile else f"read from {parsed.source}"
    console.print(f"GPU topology ({escape(where)}){': one GPU, no pairs' if parsed.gpus == 1 else ''}:")
    m = _table("", *[f"GPU{b}" for b in range(parsed.gpus)])
    for a, row in enumerate(parsed.matrix()):
        m.add_row(f"GPU{a}", *row)
    console.print(m)
