"""``blocks cluster import`` (a real inventory: the trace's node CSV or a YAML/JSON node list) and
``blocks trace replay`` (a production GPU trace through the placement code). docs/trace.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

if TYPE_CHECKING:  # the rest is imported when a command runs: `blocks` starts with typer and rich only
    from .client import Client


def _gpu_memory(values: list[str]) -> dict[str, int]:
    out = {}
    for kv in values:
        model, eq, mib = kv.partition("=")
        try:
            out[model.strip()] = int(mib)
        except ValueError:
            raise typer.BadParameter(f"expected MODEL=MIB, got {kv!r}", param_hint="--gpu-memory") from None
        if not eq or not model.strip() or out[model.strip()] <= 0:
            raise typer.BadParameter(f"expected MODEL=MIB with MIB > 0, got {kv!r}", param_hint="--gpu-memory")
    return out


def register(app: typer.Typer, cluster_app: typer.Typer, DataDir: Any) -> None:
    """Add ``cluster import`` to the ``cluster`` group and the ``trace`` group to the app."""

    def m() -> Any:
        from . import main

        return main

    @cluster_app.command("import")
    def cluster_import(
        file: Path = typer.Argument(..., help="Node list: CSV (sn,cpu_milli,memory_mib,gpu,model) or YAML/JSON."),
        cluster: str = typer.Option(..., "--cluster", "-c", help="Cluster to register the nodes in (created if new)."),
        label: list[str] = typer.Option([], "--label", "-l", help="key=value on a new cluster, repeatable."),
        node_label: list[str] = typer.Option([], "--node-label", help="key=value on every node, repeatable."),
        gpu_memory: list[str] = typer.Option(
            [], "--gpu-memory", help="MODEL=MIB: a GPU model's memory (adds to or overrides the built-in table), repeatable."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Parse and summarise; register nothing."),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
        data_dir: Path = DataDir,
    ) -> None:
        """Register a real inventory: each node with its own CPUs, memory, GPU count and GPU model
        (the `nodeType` label), as simulated nodes (the simulated fleet serves them until a real
        agent reports the node). GPU memory per model: docs/trace.md (G1-G3 assumed).

        Example: `blocks cluster import bench/traces/openb-2023/openb_node_list_gpu_node.csv --cluster openb`
        """
        from ..schemas.spec import Cluster, check_id
        from ..trace.inventory import InventoryError, load_nodes, summary

        try:
            check_id(cluster, "cluster id")
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--cluster") from None
        try:
            nodes = load_nodes(file, cluster, _gpu_memory(gpu_memory), m()._labels(node_label, "--node-label"))
        except OSError as exc:
            m().err.print(f"[red]cannot read {escape(str(file))}: {escape(str(exc))}[/]")
            raise typer.Exit(2) from None
        except InventoryError as exc:
            m().err.print(f"[red]{escape(str(file))}: {escape(str(exc))}[/]")
            raise typer.Exit(2) from None
        info = summary(nodes)
        labels = m()._labels(label)
        if not dry_run:
            async def go(c: Client) -> bool:
                return await c.import_nodes(Cluster(id=cluster, labels=labels), nodes)

            info["new_cluster"] = m()._run(m()._with_client(data_dir, go))
        info["registered"] = not dry_run
        if as_json:
            print(json.dumps(info))
            return
        models = ", ".join(f"{k} x{v}" for k, v in info["gpus_by_model"].items()) or "none"
        verb = "would register" if dry_run else "registered"
        m().console.print(f"cluster [bold]{escape(cluster)}[/]: {verb} {info['nodes']} nodes ({info['gpu_nodes']} with GPUs), "
                          f"{info['gpus']} GPUs ({escape(models)}), {info['cpu']:g} CPUs, {info['memory_mib']} MiB")
        if info["assumed_gpu_memory"]:
            m().console.print(f"GPU memory of {', '.join(info['assumed_gpu_memory'])} is assumed (undisclosed models; "
                              "--gpu-memory MODEL=MIB to set it)")
