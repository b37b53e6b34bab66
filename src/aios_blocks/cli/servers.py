"""``blocks up``, ``worker``, ``agent``, ``demo``, ``prometheus-config`` and ``settings``: the
processes and their configuration."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from ..schemas.roles import KINDS
from ..urls import mask
from .common import (
    DEMO_DATA_DIR,
    EXAMPLES,
    DataDir,
    ProcessPerKind,
    _labels,
    _one_line,
    _quiet_library_logs,
    _request,
    _run,
    _seconds_over,
    _urls,
    console,
    err,
)
from .render import _line, _plain, _print_block, _table

if TYPE_CHECKING:
    from ..metrics.promconfig import TargetGroup
    from ..runtime.supervisor import Supervisor
    from ..schemas.records import BlockMap
    from .client import Client

def up(
    data_dir: Path = DataDir,
    parsers: int = typer.Option(1, min=0, help="Parser workers (copies: the first in its group's process, each other its own)."),
    gateways: int = typer.Option(1, min=0, help="Gateway workers (copies, like --parsers)."),
    controllers: int = typer.Option(1, min=0, help="Controller workers (copies, like --parsers)."),
    agents: int = typer.Option(1, min=0, help="Simulated node agents (copies, like --parsers)."),
    executors: int = typer.Option(1, min=0, help="Executors (copies, like --parsers; block tasks over NATS and HTTP; they share the HTTP port, which asks for HTTP Basic credentials of upstream, admin or a tenant's user when auth is on)."),
    mappers: int = typer.Option(1, min=0, help="Mappers (copies; the instance maps the executors route by, from lifecycle facts)."),
    collectors: int = typer.Option(1, min=0, help="Metrics collectors (copies, like --parsers; one writes, copies stand by; docs/metrics.md)."),
    autoscalers: int = typer.Option(1, min=0, help="Autoscalers (copies, like --parsers; each block decided by the one holding its lease; docs/autoscaling.md)."),
    checkers: int = typer.Option(1, min=0, help="Health checkers (copies, like --parsers; one decides a block at a time; docs/health.md)."),
    rebalancers: int = typer.Option(1, min=0, help="Rebalancers (copies, like --parsers; one acts at a time, by a lease; docs/rebalance.md)."),
    process_per_kind: bool = ProcessPerKind,
    console_port: int = typer.Option(0, "--console-port", min=0, max=65535, help="The web console's port (0: the one it had last time, else a free one; docs/console.md)."),
    no_console: bool = typer.Option(False, "--no-console", help="Start no web console."),
) -> None:
    """Start the embedded NATS+Redis (unless AIOS_*_URL are set) and every worker. Ctrl-C,
    SIGTERM or SIGHUP stop everything in order; if this process is killed outright, its servers
    and workers die with it. One `blocks up` per data dir: a second one exits 1 naming the first.
    An embedded server or worker process that dies is started again (a server on its port, with its
    data) and said; a server that dies 5 times within 60 s stops everything (exit 2).

    The worker kinds run grouped, three processes: front (parser, gateway and the services that
    watch running blocks: metrics, autoscaler, checker, rebalancer), the controller on its own, and serve
    (agent-sim, executor, mapper); each kind keeps its own connections as its own role, and a group whose
    kind fails is restarted whole. `--controllers N` etc. run N copies of a kind: the first in its
    group, the others as processes of their own.
    `--process-per-kind` runs each kind in a process of its own.
    The web console (docs/console.md) is served beside them: its URL and admin token are printed
    (`--console-port`, `--no-console`).

    Example: `blocks up --controllers 2`, `blocks up --data-dir /var/lib/aios &`
    """
    from . import up as _up

    layout = {"parser": parsers, "gateway": gateways, "controller": controllers, "agent-sim": agents, "executor": executors,
              "mapper": mappers, "metrics": collectors, "autoscaler": autoscalers, "checker": checkers,
              "rebalancer": rebalancers}
    # the process that stays up is a lean one (cli/up.py): this one's modules would stay resident
    _up.exec_up(data_dir, layout, process_per_kind, None if no_console else console_port)


def down(
    data_dir: Path = DataDir,
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for it to have stopped.",
                                  callback=_seconds_over()),
) -> None:
    """Stop the `blocks up` (or `blocks demo`) that runs in the data dir, as Ctrl-C or `kill PID` do:
    its workers, then NATS and Redis; wait until all are gone. Exit 0 stopped, 1 none runs there,
    5 still running after --timeout.

    Example: `blocks down`, `blocks down --data-dir /var/lib/aios`
    """
    import signal

    import psutil

    from ..runtime import lifetime

    pid = lifetime.holder(data_dir)
    if not lifetime.in_use(data_dir) or pid is None:
        err.print(f"[red]no `blocks up` runs in {escape(str(data_dir))}[/] (nothing holds its lock)")
        raise typer.Exit(1)
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        argv = []
    cmd = " ".join(argv)
    if not any("aios_blocks" in a or Path(a).name == "blocks" for a in argv):
        # the lock is held (by the servers of a `blocks up` that was killed hard?) but its pid is not ours
        err.print(f"[red]{escape(str(data_dir))} is held, but process {pid} is no `blocks up`[/]: {escape(cmd[:120]) or 'gone'}")
        raise typer.Exit(1)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while lifetime.in_use(data_dir):
        if time.monotonic() > deadline:
            err.print(f"[red]`blocks up` (pid {pid}) still runs in {escape(str(data_dir))} after {timeout:g} s[/]")
            raise typer.Exit(5)
        time.sleep(0.1)
    console.print(f"stopped `blocks up` (pid {pid}) in {escape(str(data_dir))}")


def worker(
    kind: str = typer.Argument(..., help=" | ".join(KINDS)),
    cluster: str = typer.Option(None, help="controller: serve just this cluster (its own durable); executor: serve just its blocks' tasks; metrics: collect just its blocks; autoscaler: decide just its blocks. One not registered yet is a warning in its log (worker.unknown_cluster, with the known ones): it is served once registered."),
    data_dir: Path = DataDir,
) -> None:
    """Run one worker in the foreground: AIOS_NATS_URL and AIOS_REDIS_URL, else the servers of a
    running `blocks up`, connected as the worker's own role (like the workers `blocks up` runs).

    Example: `AIOS_NATS_URL=nats://10.0.0.5:4222 AIOS_REDIS_URL=redis://10.0.0.6 blocks worker controller --cluster c1`
    """
    from ..runtime.auth import KIND_ROLE
    from ..runtime.main import configure_logging, run_worker, tune_gc
    from ..settings import load as load_settings

    if kind not in KINDS:
        err.print(f"[red]unknown worker kind {escape(kind)!r}[/]: one of {', '.join(KINDS)}")
        raise typer.Exit(2)
    nats_url, redis_url = _urls(data_dir, KIND_ROLE[kind])
    if cluster and kind == "controller" and not os.environ.get("AIOS_NATS_URL"):
        from ..runtime.auth import protect_controller

        protect_controller(data_dir, cluster)  # observers may not touch its durable controller-<cid>
    settings = load_settings()
    if kind in ("executor", "agent-sim") and not os.environ.get("AIOS_NATS_URL"):
        from ..runtime import auth, instance_key, task_users

        ep = auth.read_endpoints(data_dir)  # its HTTP port asks for the users' credentials, as blocks up's does
        if ep is not None and ep.auth:
            if kind == "executor" and not settings.executor_http_users:
                settings = settings.model_copy(update={"executor_http_users": str(task_users.path(data_dir))})
            if not settings.instance_key:  # the instances' tokens (docs/security.md)
                settings = settings.model_copy(update={"instance_key": instance_key.read(data_dir)})
    configure_logging(settings.log_level)
    tune_gc(settings.gc_gen0_threshold)
    _run(run_worker(kind, nats_url, redis_url, cluster, settings=settings), quiet=False)  # its log as configured


def _runtime_name(value: str) -> str:
    """``--runtime`` is one of ``RUNTIMES`` (an unknown one failed after connecting, exit 1)."""
    from ..agent.runtime import RUNTIMES

    if value not in RUNTIMES:
        raise typer.BadParameter(f"{value!r} is no runtime: {', '.join(RUNTIMES)}")
    return value


def _agent_problems(sim_gpus: int | None, gpu_topology: str, metrics_port: int, cpu: float | None,
                    memory: int | None) -> list[str]:
    """What is wrong with ``blocks agent``'s offer and options, every problem (they failed one at a
    time, after connecting, as 'agent failed', exit 1; a negative --sim-gpus offered none)."""
    from ..schemas.topology import PROFILES

    out = []
    if sim_gpus is not None and sim_gpus < 0:
        out.append(f"--sim-gpus must be >= 0, got {sim_gpus}")
    if gpu_topology and gpu_topology not in PROFILES:
        out.append(f"--gpu-topology: unknown GPU topology profile {gpu_topology!r} (known: {', '.join(PROFILES)})")
    if not 0 <= metrics_port <= 65535:
        out.append(f"--metrics-port must be a port 1-65535 (0: off), got {metrics_port}")
    if cpu is not None and not (math.isfinite(cpu) and cpu > 0):
        out.append(f"--cpu must be a number of CPUs > 0, got {cpu}")
    if memory is not None and memory <= 0:
        out.append(f"--memory must be MiB > 0, got {memory}")
    return out


def agent(
    node_id: str = typer.Option(..., "--node-id", help="This node's id (a subject token: letters, digits, - and _)."),
    cluster: str = typer.Option(..., "--cluster", help="The cluster this node belongs to (registered if new)."),
    runtime: str = typer.Option("docker", help="docker | process | sim", callback=_runtime_name),
    label: list[str] = typer.Option([], "--label", "-l", help="Node label key=value (repeatable)."),
    zone: str = typer.Option(None, help="Shorthand for --label zone=..."),
    rack: str = typer.Option(None, help="Shorthand for --label rack=N: a number, what RackId affinity matches (docs/affinity.md)."),
    trust_domain: str = typer.Option(None, "--trust-domain", help="Shorthand for --label trust-domain=... (Trust affinity)."),
    cpu: float = typer.Option(None, help="CPUs to offer (default: this host's)."),
    memory: int = typer.Option(None, help="Memory to offer, MiB (default: this host's)."),
    sim_gpus: int = typer.Option(None, "--sim-gpus", help="Offer N simulated GPUs instead of reading NVML."),
    gpu_topology: str = typer.Option("", "--gpu-topology", help="Simulated GPUs with this topology profile (docs/topology.md; its GPU count unless --sim-gpus)."),
    heartbeat_s: float = typer.Option(2.0, "--heartbeat-s", help="Seconds between heartbeats.", callback=_seconds_over()),
    metrics_port: int = typer.Option(0, "--metrics-port", help="Serve Prometheus metrics on PORT at the --advertise-host address (0: off); `blocks prometheus-config` lists it."),
    agent_dir: Path = typer.Option(None, "--agent-dir", show_default="<data dir>/agent",
                                   help="Working directories of instances (and the process runtime's scope: docs/agents.md)."),
    advertise_host: str = typer.Option("127.0.0.1", "--advertise-host", help="Host part of instance endpoints (http://HOST:PORT): an address the executors reach this node at."),
    data_dir: Path = DataDir,
) -> None:
    """Run the node agent of one node: start/stop its instances, heartbeat, report faults.

    Needs only NATS: AIOS_NATS_URL, or a local `blocks up` (then it connects as user `agent-<node id>`,
    which may publish only this node's subjects; AIOS_AUTH=0 servers need none). GPUs come from NVML when a driver is
    present (`nvidia-ml-py`), else none, or `--sim-gpus N`.

    Its instances take tasks only from the executors when it has its node's instance key: from a local
    `blocks up` with auth on, else AIOS_INSTANCE_NODE_KEY (`blocks instance-key --node-id N` on the
    servers' host prints it); without, they take any caller's (docs/security.md).

    Example (GPU host): `AIOS_NATS_URL=nats://10.0.0.5:4222 blocks agent --node-id gpu-7 --cluster eu-1 --runtime docker --rack 3 --zone eu-1a`
    """
    from ..agent.main import AgentOptions, run_agent
    from ..runtime.embedded import agent_nats_url
    from ..runtime.main import configure_logging, tune_gc
    from ..schemas.spec import Node
    from ..settings import load as load_settings

    labels = _labels(label)
    for key, value in (("zone", zone), ("rack", rack), ("trust-domain", trust_domain)):
        if value is not None:
            labels[key] = value
    problems = _agent_problems(sim_gpus, gpu_topology, metrics_port, cpu, memory)
    try:
        Node(id=node_id, cluster=cluster, labels=labels)
    except Exception as exc:
        problems.insert(0, f"invalid node: {_one_line(exc)}")
    if problems:
        for problem in problems:
            err.print(f"[red]{escape(problem)}[/]")
        raise typer.Exit(2)
    try:  # with a local `blocks up`: as user agent-<node id>, added to the server on first use
        nats_url = agent_nats_url(data_dir, node_id)
    except (OSError, KeyError, RuntimeError) as exc:
        err.print(f"[red]Cannot get the credentials of node {escape(node_id)} from {data_dir}[/]: "
                  f"{type(exc).__name__}: {escape(mask(str(exc)))}")
        raise typer.Exit(2)
    if not nats_url:
        err.print("[red]No NATS.[/] Set AIOS_NATS_URL (the agent needs only NATS) or run `blocks up` here.")
        raise typer.Exit(2)
    configure_logging(load_settings().log_level)
    tune_gc(load_settings().gc_gen0_threshold)
    # (was ./.aios-data/agent wherever the agent was started, whatever its --data-dir: two systems'
    # agents started from one directory shared a process scope, and a stray .aios-data appeared)
    agent_dir = agent_dir or Path(data_dir) / "agent"
    opts = AgentOptions(
        node_id=node_id, cluster=cluster, runtime=runtime, labels=labels, cpu=cpu, memory=memory, sim_gpus=sim_gpus,
        gpu_topology=gpu_topology, data_dir=agent_dir, heartbeat_s=heartbeat_s, metrics_port=metrics_port, advertise_host=advertise_host,
        drain_grace_s=load_settings().drain_grace_s,
    )

    async def go() -> None:
        from ..workers.base import stop_on_signals

        await run_agent(opts, nats_url, stop_on_signals())

    try:
        _run(go(), quiet=False)  # its JSON log at AIOS_LOG_LEVEL, as configured above
    except typer.Exit:  # _run's own one line and exit code (2: servers unreachable), not 'agent failed: 2', exit 1
        raise
    except Exception as exc:  # e.g. no Docker engine
        err.print(f"[red]agent failed[/]: {escape(str(exc))}")
        raise typer.Exit(1)


def instance_key(
    node_id: str = typer.Option(..., "--node-id", help="The node whose agent the key is for."),
    data_dir: Path = DataDir,
) -> None:
    """Print the instance key of node N's agent (AIOS_INSTANCE_NODE_KEY=...), for an agent on another
    host: derived from the system's key (AIOS_INSTANCE_KEY, else DATA_DIR/auth/instance-key, which
    `blocks up` makes with auth on), so it gives that agent its own instances' tokens only.

    Example: `blocks instance-key --node-id gpu-7`, then on gpu-7: `AIOS_INSTANCE_NODE_KEY=... blocks agent --node-id gpu-7 ...`
    """
    from ..runtime import instance_key as ik
    from ..schemas.spec import Node
    from ..settings import load as load_settings

    try:
        Node(id=node_id, cluster="c")
    except Exception as exc:
        err.print(f"[red]invalid node id[/]: {escape(_one_line(exc))}")
        raise typer.Exit(2)
    key = load_settings().instance_key or ik.read(data_dir)
    if not key:
        err.print(f"[red]No instance key[/]: set AIOS_INSTANCE_KEY, or run `blocks up` with auth on in {escape(str(data_dir))}")
        raise typer.Exit(2)
    print(f"{ik.NODE_KEY_ENV}={ik.node_key(key, node_id)}")


def demo(
    data_dir: Path = DataDir,
    timeout: float = typer.Option(120, help="Give up after this many seconds.", callback=_seconds_over()),
    process_per_kind: bool = ProcessPerKind,
) -> None:
    """Start everything, register an example component and 3 simulated clusters x 8 nodes x 8 GPUs,
    submit an example block and show its lifecycle until it is ready.

    On a terminal it keeps running (Ctrl-C stops); otherwise it exits 0 once the block is ready. An
    embedded server that dies is started again, as in `blocks up` (docs/reliability.md).
    Its servers stop with it, but its stream and state stay in its own data dir (`./.aios-demo`
    unless --data-dir says otherwise, apart from a `blocks up`'s `./.aios-data`): it prints the
    commands that start them again and replay the block.
    Example: `blocks demo`
    """
    import shlex

    from . import up as _up

    code, bid = 1, None
    with _up.running(data_dir, process_per_kind=process_per_kind) as (servers, sup):
        keeper = _up.ServerKeeper(servers) if servers else None  # a dead embedded server is started again, as in `blocks up`
        code, bid = _run(_up.kept(keeper, _demo(sup, timeout, Path(data_dir))))
        if code == 0 and sys.stdout.isatty():
            where = "" if data_dir == DEMO_DATA_DIR else f" --data-dir {shlex.quote(str(data_dir))}"
            console.print(f"[dim]demo is up; Ctrl-C to stop (other terminals: blocks list{where} / watch / scale)[/]")
            _up.keep_servers(keeper)
    if bid is not None:
        dd = shlex.quote(str(data_dir))
        console.print(escape(f"the demo's servers stopped; its stream and state stay in {data_dir}. To look at block {bid} again:"))
        console.print(escape(f"  blocks up --data-dir {dd} &"))
        console.print(escape(f"  blocks replay {bid} --data-dir {dd}    (or: blocks explain / get {bid} --data-dir {dd})"))
    raise typer.Exit(code)


async def _demo(sup: Supervisor, timeout: float, data_dir: Path) -> tuple[int, str | None]:
    """The demo's exit code, and its block's id (None: none was submitted)."""
    import yaml

    from .client import TERMINAL, Client

    _quiet_library_logs()
    client = await Client.open(sup.nats_url, sup.redis_url)
    try:
        comp = await client.add_component(yaml.safe_load((EXAMPLES / "component.yaml").read_text()))
        for i in range(3):
            await client.add_sim_cluster(f"cluster-{i}", nodes=8, gpus=8, labels={"region": f"r{i}"})
        console.print(f"registered component [bold]{comp.componentURI}[/] and 3 clusters x 8 nodes x 8 GPUs")
        spec = yaml.safe_load((EXAMPLES / "block.yaml").read_text())
        started = time.perf_counter()
        bid = await client.submit(spec)
        console.print(f"submitted block [bold]{bid}[/]")
        try:
            kind = await _wait_through_restarts(client, bid, timeout, started)
        except TimeoutError:
            err.print(f"[red]block {bid} not ready after {timeout}s[/]")
            return 1, bid
        await _print_block(client, bid)
        if kind == "ready":
            console.print(f"[green bold]block {bid} ready[/] in {time.perf_counter() - started:.3f}s")
            await _demo_tasks(client, bid, data_dir)
        return TERMINAL[kind], bid
    finally:
        await client.close()


async def _wait_through_restarts(client: Client, bid: str, timeout: float, started: float) -> str:
    """``client.wait`` for the block's end, followed again from its first event (those shown
    skipped) when the follow ends early: its nats-server died and was started again (``up.kept``)."""
    import asyncio

    deadline, shown = time.monotonic() + timeout, 0
    while True:
        n = 0

        def show(s: str, e: Any) -> None:
            nonlocal n, shown
            n += 1
            if n > shown:
                shown = n
                console.print(f"{time.perf_counter() - started:7.3f}s  {_line(s, e)}")

        try:
            return (await client.wait(bid, max(0.1, deadline - time.monotonic()), on_event=show))[0]
        except (TimeoutError, ConnectionError):
            if time.monotonic() >= deadline:
                raise TimeoutError(bid) from None
            await asyncio.sleep(0.5)


async def _demo_tasks(client: Client, bid: str, data_dir: Path) -> None:
    """Tasks through the executor: a few to the example block (simulated instances echo them),
    then the OCR block's images when the `ocr` extra is installed (a real model)."""
    import asyncio

    async with asyncio.timeout(30):  # the mapper's map reaches the executor just after `ready`
        while True:
            if (await client.task(bid, b"{}", timeout=10))[0] == 200:
                break
            await asyncio.sleep(0.1)
    for n in range(3):
        status, body, h = await client.task(bid, json.dumps({"prompt": f"task {n}"}).encode(), {"Content-Type": "application/json"})
        console.print(escape(f"task {n} -> {status} from {h.get('Aios-Instance', '?')}: {body.decode(errors='replace')[:120]}"))
    from ..examples.ocr import available
    from ..examples.ocr import demo as ocr_demo

    why = available()
    if why:
        console.print(f"[dim]OCR block skipped: {escape(why)}[/]")
        return

    async def send(obid: str, task: dict[str, Any]) -> dict[str, Any]:
        status, body, h = await client.task(obid, json.dumps(task).encode(), {"Content-Type": "application/json"}, 120)
        if status != 200:
            raise RuntimeError(f"executor answered {status}: {h.get('Aios-Error') or body[:200]!r}")
        out: dict[str, Any] = json.loads(body)
        return out

    async def via_executor(obid: str, task: dict[str, Any]) -> dict[str, Any]:
        async with asyncio.timeout(60):  # as above: the OCR block's map reaches the executor
            while True:
                try:
                    return await send(obid, task)
                except RuntimeError as exc:
                    if "404" not in str(exc) and "no ready instance" not in str(exc):
                        raise
                await asyncio.sleep(0.2)

    await ocr_demo.run(client, data_dir, send=via_executor, say=lambda line: console.print(line))


def prometheus_config(
    static: bool = typer.Option(False, "--static", help="List the targets of this moment instead of the collector's http_sd URLs."),
    scrape_interval: str = typer.Option("15s", "--scrape-interval", help="Prometheus scrape_interval."),
    refresh_interval: str = typer.Option("30s", "--refresh-interval", help="How often Prometheus re-reads the targets (http_sd)."),
    data_dir: Path = DataDir,
) -> None:
    """Print a Prometheus scrape config (YAML) for the running system: the workers' /metrics
    (job aios-workers; node agents started with --metrics-port too, kind agent) and every block instance's /metrics (job aios-instances; labels block,
    instance, cluster, node). By default the targets come from the metrics collector's http_sd
    endpoints (`endpoints.json` "metrics"), so they follow the system; --static lists them as
    they are now (from the metrics store and the instance records).

    Example: `blocks prometheus-config > prometheus.yml && prometheus --config.file prometheus.yml`
    """
    from ..metrics import promconfig

    sd_url = None
    if not static:
        ep = data_dir / "endpoints.json"
        try:
            sd_url = json.loads(ep.read_text()).get("metrics") if ep.exists() else None
        except (OSError, ValueError):
            sd_url = None
        if not sd_url and ep.exists():  # (no endpoints.json at all: "No servers" says it, below)
            err.print("[yellow]no metrics collector address in endpoints.json: listing the targets of this moment (--static)[/]")

    async def go(c: Client) -> tuple[list[TargetGroup], list[TargetGroup]]:
        workers = promconfig.worker_targets(await c.store.metrics.targets())
        maps: dict[str, BlockMap] = {}
        clusters: dict[str, str] = {}
        for b in await c.store.list_blocks(100_000):
            insts = await c.store.instances(b)
            maps[b] = {"instances": {i: {"endpoint": r.get("endpoint", ""), "node": r.get("node", ""),
                                         "state": "stopping" if r.get("status") in ("failed", "removing", "removed") else "ready"}
                                     for i, r in insts.items()}}
            clusters[b] = next((str(r.get("cluster", "")) for r in insts.values()), "")
        return workers, promconfig.instance_targets(maps, clusters)

    workers: list[TargetGroup] = []
    instances: list[TargetGroup] = []
    if not sd_url:
        workers, instances = _request(go, data_dir, store_only=True)
    sys.stdout.write(promconfig.config(sd_url, workers, instances, scrape_interval, refresh_interval))


def settings_(
    markdown: bool = typer.Option(False, "--markdown", help="Print docs/settings.md's table."),
) -> None:
    """Every AIOS_* setting: its value in this environment, its default and what it does.
    Example: `blocks settings`, `AIOS_NODE_TIMEOUT_S=5 blocks settings`"""
    from .. import settings as st

    if markdown:
        print(st.markdown())
        return
    current = st.load()
    t = _table("variable", "value", "default", "meaning")
    for name, f in st.Settings.model_fields.items():
        value = getattr(current, name)
        shown = "(set)" if name == "event_key" and value else str(value)
        t.add_row(*_plain(f"AIOS_{name.upper()}", shown, f.default, f.description or ""))
    console.print(t)
