"""``blocks cluster import`` (a real inventory: the trace's node CSV or a YAML/JSON node list) and
``blocks trace replay`` (a production GPU trace through the placement code). docs/trace.md."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

if TYPE_CHECKING:  # the rest is imported when a command runs: `blocks` starts with typer and rich only
    from ..schemas.spec import Node
    from .client import Client

#: ``blocks trace replay``'s policy when no ``--policy`` is given: ``trace.replay.DEFAULT_POLICY``
#: by its short name (not imported here: ``blocks`` starts with typer and rich only)
DEFAULT_POLICY = "fgd-plus"


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


#: where the trace the docs and examples name lives; the wheel does not carry it (its owners allow
#: research and study use only: bench/traces/openb-2023/README.md)
TRACE_DIR = "bench/traces/openb-2023"


def missing_trace_hint(path: Path | str) -> str:
    """What to add to "cannot read PATH" when PATH is one of the trace files the docs name and is not
    here (an installed wheel, or a command run outside the repository): where to get it."""
    if TRACE_DIR not in str(path) or Path(path).exists():
        return ""
    return (f" (the trace is not in the wheel: run this from a checkout of the repository, which has {TRACE_DIR}/,"
            " or take the csv folder of cluster-trace-gpu-v2023 from github.com/alibaba/clusterdata; docs/trace.md)")


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
        gpu_topology: str = typer.Option(None, "--gpu-topology", show_default=False,
                                         help="GPU topology profile of every node with that many GPUs (docs/topology.md); "
                                              "a node's own `gpu-topology` label wins."),
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
            m().err.print(f"[red]cannot read {escape(str(file))}: {escape(str(exc))}[/]{escape(missing_trace_hint(file))}")
            raise typer.Exit(2) from None
        except InventoryError as exc:
            m().err.print(f"[red]{escape(str(file))}: {escape(str(exc))}[/]")
            raise typer.Exit(2) from None
        try:
            nodes = with_topology(nodes, gpu_topology)
        except ValueError as exc:
            m().err.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(2) from None
        info = summary(nodes)
        info["gpu_topology_nodes"] = sum(1 for n in nodes if n.topology is not None)
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

    trace_app = typer.Typer(help="Replay production GPU traces through the placement code (docs/trace.md).",
                            no_args_is_help=True)
    app.add_typer(trace_app, name="trace")

    @trace_app.command("replay")
    def trace_replay(
        nodes_file: Path = typer.Argument(..., metavar="NODES", help="Node list (as for `blocks cluster import`)."),
        pods_file: Path = typer.Argument(..., metavar="PODS", help="Task list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos])."),
        in_process: bool = typer.Option(False, "--in-process", help="Run the placement code in this process (no servers)."),
        live: bool = typer.Option(
            False, "--live", help="Through a running system: `blocks up` (a fresh one: no cluster yet), else NATS, Redis and "
            "the workers started by the command for each run. Same decisions as --in-process for the same seed."),
        policy: list[str] = typer.Option(
            [DEFAULT_POLICY], "--policy", "-p",
            help="resourceAllocator, repeatable: fgd-plus (ours, the default: above FGD's published figures on the trace's "
            "17 workloads, docs/trace.md), random, dot-product, gpu-packing, gpu-clustering, best-fit, fgd, binpack, spread, "
            "or a policyRuleURI."),
        seed: list[int] = typer.Option([42], "--seed", "-s", help="Sampling and shuffling seed, repeatable."),
        inflate: float = typer.Option(1.3, "--inflate", min=0.01, max=10.0,
                                      help="Sample tasks until their GPU requests reach this many times the cluster's GPUs."),
        sample_nodes: int = typer.Option(0, "--sample-nodes", min=0,
                                         help="The resourceAllocator's sampleNodes (0: every node is seen, as the paper's "
                                         "simulator does)."),
        json_out: Path = typer.Option(None, "--json", help="Write the figures as JSON (an object; a list for several runs)."),
        plot: Path = typer.Option(None, "--plot", help="Draw allocation vs arrived for the runs (PNG; needs matplotlib)."),
        anchor: Path = typer.Option(None, "--anchor", help="The artifact's published means (anchor_fgd_atc23.csv) to print beside "
                                    "ours; default: the one next to PODS, if any."),
        timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="--live: seconds a block may take to be ready or failed."),
        online: bool = typer.Option(
            False, "--online", help="Each task arrives at its creation_time and runs until deletion_time - creation_time "
            "after it is placed, with the pending queue, priorities (QoS) and preemption (docs/priority.md 'Online replay')."),
        speed: float | None = typer.Option(None, "--speed", min=1e-6, help="--online --live: submit and delete on the wall clock, "
                                    "this many trace seconds per wall second; without it the replay steps trace time one "
                                    "event at a time, each once the system is quiet: the same decisions as --in-process "
                                    "(docs/priority.md 'Same decisions')."),
        load: float = typer.Option(1.0, "--load", min=1e-6, help="--online: arrival times divided by this (durations kept): "
                                   "the trace's own times keep its cluster at ~1 % busy."),
        cluster_share: float = typer.Option(1.0, "--cluster-share", min=1e-6, max=1.0,
                                            help="--online: a seeded sample of this share of the nodes, per GPU model."),
        no_preemption: bool = typer.Option(False, "--no-preemption", help="--online: a run with the queue but no preemption."),
        fifo: bool = typer.Option(False, "--fifo", help="--online: a run with the queue by age only (no priority, no preemption)."),
        rebalance: bool = typer.Option(False, "--rebalance", help="--online: each run twice, without and with the rebalancer "
                                       "(moves before preemption; docs/rebalance.md 'Online replay'): moves, the last third's "
                                       "allocation, the multi-GPU tasks' wait."),
        data_dir: Path = DataDir,
    ) -> None:
        """Replay a GPU trace: tasks sampled with a seed until their GPU requests reach --inflate x the
        cluster's GPUs, shuffled, placed one at a time, never deleted (a task that fits nowhere fails;
        the replay goes on). Prints the GPU allocation rate at each 1 % of arrived GPU requests, at
        100 % and at the end (~130 %), FGD's fragmentation measure, failures by reason, seconds.
        --in-process runs the placement code here; --live submits each task as a block to a running
        system (`blocks up`, else servers and workers it starts) and reads the placements back.

        Example: `blocks trace replay bench/traces/openb-2023/openb_node_list_gpu_node.csv
        bench/traces/openb-2023/openb_pod_list_default.csv --in-process --policy fgd --policy best-fit --json out.json`
        """
        import asyncio

        from ..trace import replay as rp
        from ..trace.inventory import InventoryError, load_nodes
        from ..trace.workload import WorkloadError, load_tasks

        err, console = m().err, m().console
        if in_process == live:
            err.print("[red]give --in-process[/] (the policies and the placement code in this process) [red]or --live[/] "
                      "(through a running system)")
            raise typer.Exit(2)
        if in_process and (stored := [p for p in policy if p.startswith("registry:") or p.endswith((".py", ".star"))]):
            err.print(f"[red]--in-process has no policy registry[/] for {escape(', '.join(stored))}: give --live (a system "
                      "whose registry holds it: blocks policy add), a built-in or package.module:Class")
            raise typer.Exit(2)
        if problems := rp.policy_problems(policy) + _unwritable({"--json": json_out, "--plot": plot}):
            for line in problems:
                err.print(f"[red]{escape(line)}[/]", emoji=False)
            raise typer.Exit(2)
        if plot is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                err.print("[red]--plot needs matplotlib[/]: pip install 'aios-blocks\\[trace]' (or pip install matplotlib)")
                raise typer.Exit(2) from None
        try:
            nodes = load_nodes(nodes_file, "trace")
            tasks = load_tasks(pods_file)
        except OSError as exc:
            err.print(f"[red]cannot read {escape(str(exc.filename or ''))}: {escape(exc.strerror or str(exc))}[/]"
                      f"{escape(missing_trace_hint(exc.filename or ''))}")
            raise typer.Exit(2) from None
        except (InventoryError, WorkloadError) as exc:
            err.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(2) from None
        workload = pods_file.stem.removeprefix("openb_pod_list_")
        if online:
            _online(nodes, pods_file, workload, live, policy, seed, sample_nodes, no_preemption, fifo, json_out, plot, load,
                    cluster_share, rebalance, speed=speed)
            return
        anchors = _anchors(anchor or pods_file.with_name("anchor_fgd_atc23.csv"), workload)
        runs = [(rp.policy_uri(p), s) for p in policy for s in seed]
        urls = _live_urls(data_dir, len(runs)) if live else None
        results = []
        for uri, s in runs:
            if live:
                res = _live_run(urls, nodes, tasks, uri, s, inflate, sample_nodes, workload, timeout)
            else:
                res = asyncio.run(rp.replay(nodes, tasks, uri, s, inflate, sample_nodes, workload))
            results.append(res.as_dict())
            _print_run(console, results[-1], anchors.get(rp.ANCHOR_NAMES.get(uri, "")))
        if json_out is not None:
            json_out.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=1) + "\n")
            console.print(f"figures written to {escape(str(json_out))}")
        if plot is not None:
            draw(results, plot)
            console.print(f"plot written to {escape(str(plot))}")


def _unwritable(outputs: dict[str, Path | None]) -> list[str]:
    """Each output file the replay could not write at its end (its work lost): a directory, or
    in a directory that is not there. Checked before the replay."""
    out = []
    for option, path in outputs.items():
        if path is None:
            continue
        if path.is_dir():
            out.append(f"{option} {path}: is a directory")
        elif not path.parent.is_dir():
            out.append(f"{option} {path}: there is no directory {path.parent}")
    return out


def _online(nodes: list[Any], pods_file: Path, workload: str, live: bool, policy: list[str], seed: list[int],
            sample_nodes: int, no_preemption: bool, fifo: bool, json_out: Path | None, plot: Path | None,
            load: float = 1.0, cluster_share: float = 1.0, rebalance: bool = False, speed: float | None = None) -> None:
    """``--online``: the runs asked (preemption unless only --no-preemption/--fifo), printed."""
    import asyncio

    from ..trace import online as on
    from ..trace import online_rebalance as orb

    console, err = _main().console, _main().err
    try:
        timed, drawn = on.load_timed(pods_file, seed[0])
    except ValueError as exc:
        err.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None
    if live:
        _online_live(nodes, timed, workload, policy, seed, no_preemption or fifo or rebalance, json_out, load, cluster_share, speed)
        return
    modes = [on.Mode.NO_PREEMPTION] * no_preemption + [on.Mode.FIFO] * fifo or [on.Mode.PREEMPTION]
    results = []
    for p in policy:
        for s in seed:
            for mode, moves in [(md, mv) for md in modes for mv in ((False, True) if rebalance else (None,))]:
                if moves is None:
                    d = asyncio.run(on.replay_online(nodes, timed, mode, p, s, sample_nodes, workload=workload, drawn=drawn,
                                                     load=load, cluster_share=cluster_share)).as_dict()
                else:
                    d = asyncio.run(orb.replay(nodes, timed, mode, p, s, sample_nodes, workload=workload, drawn=drawn,
                                               load=load, cluster_share=cluster_share, rebalance=moves))
                results.append(d)
                waits = ", ".join(f"{c} p50 {w['p50']:g} s / p99 {w['p99']:g} s" for c, w in d["wait"].items())
                console.print(f"[bold]{escape(workload or 'trace')}[/] {d['mode']} ({escape(d['policy'])}, seed {s}, "
                              f"{d['tasks']} tasks, load x{d['load']:g}, {d['nodes']} nodes): mean GPU allocation {d['alloc_mean']:.2f} %; preemptions "
                              f"{d['preemptions']} ({d['victims']} victims), cascades {d['cascades']}, GPU-seconds lost "
                              f"{d['gpu_s_lost']:g}, pending at the end {d['pending_end']}")
                console.print(f"  wait (trace seconds): {escape(waits)}")
                if moves is not None:
                    mg = d["multi_gpu_wait"]
                    console.print(f"  moves {d['moves']} ({d['moves_per_placement']:g} per placement), GPU allocation of the "
                                  f"last third {d['alloc_last_third']:.2f} %, multi-GPU wait p50 {mg['p50']:g} s / p99 {mg['p99']:g} s")
    if json_out is not None:
        json_out.write_text(json.dumps(results, indent=1) + "\n")
        console.print(f"figures written to {escape(str(json_out))}")
    if plot is not None:
        on.draw(results, plot)
        console.print(f"plot written to {escape(str(plot))}")


def _online_live(nodes: list[Any], timed: list[Any], workload: str, policy: list[str], seed: list[int], other_mode: bool,
                 json_out: Path | None, load: float, cluster_share: float, speed: float | None) -> None:
    """``--online --live``: one run through servers and workers started for it (the system's own
    queue, classes and preemption decide; ``trace/online_live.py``): in trace time, one event at a
    time (``replay_online_lockstep``, its workers' settings ``LOCKSTEP_ENV`` unless set), or on the
    wall clock at ``speed``."""
    import os

    from ..trace import live
    from ..trace import online_live as ol

    console, err = _main().console, _main().err
    if other_mode or len(policy) > 1 or len(seed) > 1:
        err.print("[red]--online --live runs one policy and seed, with preemption[/] (the system's own): "
                  "--no-preemption, --fifo and --rebalance are --in-process only")
        raise typer.Exit(2)

    async def go() -> Any:
        from .client import Client

        async with contextlib.AsyncExitStack() as stack:
            nats_url, redis_url, _ = await stack.enter_async_context(live.own_system(lambda s: console.print(escape(s))))
            client = await Client.open(nats_url, redis_url)
            stack.push_async_callback(client.close)
            if speed is None:
                return await ol.replay_online_lockstep(client, nodes, timed, policy[0], seed[0], load, cluster_share,
                                                       workload=workload, progress=lambda s: console.print(escape(s)))
            return await ol.replay_online_live(client, nodes, timed, speed, policy[0], seed[0], load, cluster_share,
                                               workload=workload, progress=lambda s: console.print(escape(s)))

    # the workers it starts take the environment: LOCKSTEP_ENV for a lockstep run, unless set (put back after)
    added = {k: v for k, v in ol.LOCKSTEP_ENV.items() if k not in os.environ} if speed is None else {}
    os.environ.update(added)

    try:
        d = _main()._run(go())
    except live.LiveError as exc:
        err.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    finally:
        for k in added:
            os.environ.pop(k, None)
    waits = ", ".join(f"{c} p50 {w['p50']:g} s / p99 {w['p99']:g} s" for c, w in d["wait"].items())
    console.print(f"[bold]{escape(workload or 'trace')}[/] live ({escape(d['policy'])}, seed {d['seed']}, {d['tasks']} tasks, "
                  f"{'trace time, lockstep' if speed is None else f'speed x{speed:g}'}, load x{d['load']:g}, {d['nodes']} nodes): "
                  f"placed {d['placed']}, preemptions "
                  f"{d['preemptions']} ({d['victims']} victims), cascades {d['cascades']}, GPU-seconds lost {d['gpu_s_lost']:g}, "
                  f"pending at the end {d['pending_end']}")
    console.print(f"  wait (trace seconds): {escape(waits)}")
    if json_out is not None:
        json_out.write_text(json.dumps([d], indent=1) + "\n")
        console.print(f"figures written to {escape(str(json_out))}")


def _live_urls(data_dir: Path, runs: int) -> tuple[str, str] | None:
    """A running system's URLs (``AIOS_NATS_URL``/``AIOS_REDIS_URL``, else `blocks up` in the data
    dir), or None: each run starts its own. A running system takes one run: its blocks stay."""
    from ..runtime.locate import resolve_urls
    from .common import _why

    err = _main().err
    try:
        urls = resolve_urls(data_dir, wait_s=0)
    except (OSError, KeyError) as exc:
        err.print(f"[red]Cannot read the credentials of the servers in {escape(str(data_dir))}[/]: "
                  f"{_why(exc)}")
        raise typer.Exit(2) from None
    if urls is not None and runs > 1:
        err.print(f"[red]{runs} runs asked (policies x seeds), and a running system takes one[/]: a live replay's blocks are "
                  "never deleted. Give one policy and one seed, or stop `blocks up` and let the command start its own "
                  "servers for each run")
        raise typer.Exit(2)
    return urls


def _live_run(urls: tuple[str, str] | None, nodes: list[Any], tasks: list[Any], uri: str, seed: int, inflate: float,
              sample_nodes: int, workload: str, timeout: float) -> Any:
    """One ``--live`` run: through the system at ``urls``, else through servers and workers
    started for it (stopped after)."""
    from ..trace import live

    console, err = _main().console, _main().err

    def progress(done: int, total: int) -> None:
        console.print(f"  {done} of {total} blocks decided")

    async def go() -> Any:
        from .client import Client

        async with contextlib.AsyncExitStack() as stack:
            if urls is None:
                nats_url, redis_url, _ = await stack.enter_async_context(
                    live.own_system(lambda s: console.print(escape(s))))
            else:
                nats_url, redis_url = urls
            client = await Client.open(nats_url, redis_url)
            stack.push_async_callback(client.close)
            return await live.replay_live(client, nodes, tasks, uri, seed, inflate, sample_nodes, workload, progress, timeout)

    try:
        return _main()._run(go())
    except live.LiveError as exc:
        err.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None


def _main() -> Any:
    from . import main

    return main


def _anchors(path: Path, workload: str) -> dict[str, tuple[float, float]]:
    """The artifact's mean allocation at 100 % and 130 % per policy, for this workload."""
    import csv

    try:
        with path.open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return {}
    return {r["policy"]: (float(r["gpu_alloc_pct_at_100pct_arrived"]), float(r["gpu_alloc_pct_at_130pct_arrived"]))
            for r in rows if r.get("workload") == workload}


def _print_run(console: Any, r: dict[str, Any], anchor: tuple[float, float] | None) -> None:
    top = round(r["inflate"] * 100)
    line = (f"[bold]{escape(r['policy'])}[/] seed {r['seed']} on {escape(r['workload'] or 'trace')} ({r['nodes']} nodes, "
            f"{r['gpus']} GPUs): allocation {r['alloc_at_100']:.2f} % at 100 % arrived, {r[f'alloc_at_{top}']:.2f} % at "
            f"{r['arrived_end']:.1f} %; fragmentation {r['frag_at_100']:.2f} % / {r[f'frag_at_{top}']:.2f} %")
    if anchor:
        line += f"; the artifact's mean: {anchor[0]:.2f} % / {anchor[1]:.2f} %"
    console.print(line)
    console.print(f"  {r['blocks']} blocks, {r['placed']} placed, {r['failed']} failed "
                  f"({', '.join(f'{k}: {v}' for k, v in r['failures'].items()) or 'none'}); "
                  f"{r['seconds']:.1f} s, {r['placements_per_s']:.0f} placements/s"
                  + (f", create->ready p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms (live)" if r.get("mode") == "live" else ""))
    curve = r["alloc_curve"]
    keys = sorted(curve, key=int)
    for i in range(0, len(keys), 10):
        chunk = keys[i:i + 10]
        console.print(f"  arrived {chunk[0]:>3}-{chunk[-1]:>3} %: " + " ".join(f"{curve[k]:.2f}" for k in chunk))


def draw(results: list[dict[str, Any]], path: Path) -> None:
    """GPU allocation (%) against arrived GPU requests (%), one line per run (the paper's Fig. 9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = sorted(int(k) for k in r["alloc_curve"])
        label = f"{r['policy'].removeprefix('builtin:')} (seed {r['seed']})" if len({x['seed'] for x in results}) > 1 \
            else r["policy"].removeprefix("builtin:")
        ax.plot(xs, [r["alloc_curve"][str(x)] for x in xs], label=label)
    ax.plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("arrived GPU requests (% of the cluster's GPUs)")
    ax.set_ylabel("GPU allocation rate (%)")
    wl = results[0]["workload"] if results else ""
    ax.set_title(f"{wl}: {results[0]['nodes'] if results else 0} nodes, {results[0]['gpus'] if results else 0} GPUs")
    ax.set_xlim(0, max((int(k) for r in results for k in r["alloc_curve"]), default=130))
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def with_topology(nodes: list[Node], default: str | None) -> list[Node]:
    """Each node with the GPU topology profile its ``gpu-topology`` label names, else ``default``
    when the node has that profile's GPU count (docs/topology.md); ValueError for an unknown
    profile or a label naming one of another GPU count."""
    from ..schemas.topology import profile

    out = []
    for n in nodes:
        name = n.labels.get("gpu-topology") or default
        if name and n.topology is None:
            topo = profile(name)
            if len(n.gpus) == topo.gpus:
                n = n.model_copy(update={"topology": topo})
            elif n.labels.get("gpu-topology"):
                raise ValueError(f"node {n.id}: gpu-topology {name} has {topo.gpus} GPUs, the node {len(n.gpus)}")
        out.append(n)
    return out
