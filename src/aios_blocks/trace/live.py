"""``blocks trace replay --live``: the same protocol as ``--in-process`` (``trace.replay``) through a
running system: the node list imported as a cluster (``Client.import_nodes``, what ``blocks
cluster import`` does), each sampled task submitted as a block through the client's create path
(``Client.create``) in the replay's order, its outcome awaited (ready, or failed/rejected: the
task fits nowhere, the replay goes on), nothing deleted or moved (``block_spec``). ``window``
creates in flight at most: 1 (the default) is one at a time, each awaited, the order the
in-process mode decides in; more
pipelines the creates (published in order, gathered into the bus's batches), and the system then
decides in the order its workers reach the cluster's plan lock (docs/trace.md "Live vs Ray").

The figures are computed from what the system placed: each block's instance (node and GPUs) read
back from the state store after the run and fed, in the replay's order, to the same ``Ledger`` as
the in-process mode; the final allocation is checked against the node hashes the reservation
script wrote (``LiveMismatch`` if they disagree). Same seed, same decisions: docs/trace.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ..schemas.spec import Cluster, Node
from .replay import Ledger, Result, Setup, block_id, held_milli, labels, setup
from .workload import UNITS, Task

#: the cluster the node list is imported as (the in-process mode's name too)
CLUSTER = "trace"
#: one component per kind of task: whole GPUs (or none), and GPU-sharing
COMPONENT_WHOLE = "aios://trace/task"
COMPONENT_SHARED = "aios://trace/task-shared"
#: the workers a self-started system runs (the placement path; `blocks up`'s others, the executor,
#: metrics collector, autoscaler and checker, have nothing to do in a replay)
LAYOUT = {"parser": 1, "gateway": 1, "controller": 1, "agent-sim": 1}
TERMINAL = ("ready", "failed", "rejected")


class LiveError(RuntimeError):
    """The system cannot take a live replay (said why)."""


class LiveMismatch(LiveError):
    """What was read back from the state does not add up to the node hashes."""


def components(st: Setup) -> list[dict[str, Any]]:
    """The two components the blocks are made from: the replay's resourceAllocator (with and
    without GPU sharing) and the built-in clusterAllocator."""
    return [
        {"componentURI": uri, "resources": {},
         "policies": [{"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"}, st.rule(share)]}
        for uri, share in ((COMPONENT_WHOLE, False), (COMPONENT_SHARED, True))
    ]


def block_spec(t: Task) -> dict[str, Any]:
    """The block of one task: its resources, the component of its kind, its QoS as a label, and
    never moved nor preempted (``preemptible: false``): the replay measures placement decisions, one
    at a time and kept, as ``--in-process`` does. A movable block would be moved by the system's
    rebalancer (``blocks up`` runs one: docs/rebalance.md) whenever its tick lands while the
    cluster's fragmentation is above ``AIOS_REBALANCE_FRAG_THRESHOLD``, and every later decision
    would then be taken on other node views: figures that depend on the timing, not the policy."""
    spec: dict[str, Any] = {"blockId": block_id(t), "blockComponentURI": COMPONENT_SHARED if t.sharing else COMPONENT_WHOLE,
                            "minInstances": 1, "maxInstances": 1, "resources": t.resources(),
                            # the offline replay counts a task that fits nowhere on arrival as failed,
                            # as the in-process replay does: not the pending queue (docs/priority.md)
                            "queue": False, "preemptible": False}
    if t.qos:
        spec["labels"] = labels(t)
    return spec


@contextlib.asynccontextmanager
async def own_system(log: Callable[[str], None] = lambda s: None) -> AsyncIterator[tuple[str, str, Path]]:
    """Embedded NATS JetStream (fsync per ``AIOS_NATS_SYNC``, default always) and Redis in a fresh
    temporary data dir, and the placement path's workers (``LAYOUT``) in `blocks up`'s process
    groups; everything stopped and removed on exit."""
    from ..runtime.embedded import EmbeddedServers
    from ..runtime.supervisor import DEFAULT_GROUPS, Supervisor

    data = Path(tempfile.mkdtemp(prefix="aios-trace-live-"))
    # (the stream and consumers made by a child, as `blocks up` makes them: their creation's log lines
    # went to this process's stdout, among the figures)
    servers = EmbeddedServers(data_dir=data, topology_in_child=True).start()
    sup = None
    try:
        sup = Supervisor(servers.nats_url, servers.redis_url, dict(LAYOUT), log_dir=str(data / "logs"),
                         role_env=servers.worker_env, groups=DEFAULT_GROUPS).start()
        log(f"started NATS, Redis and the workers ({', '.join(LAYOUT)}) in {data}")
        yield servers.nats_url, servers.redis_url, data
    finally:
        if sup is not None:
            sup.stop()
        servers.stop()
        shutil.rmtree(data, ignore_errors=True)


class Outcomes:
    """Terminal events of the blocks, by block id, from a core NATS subscription (no consumer
    per block): (kind, when received, the event's data). ``steps``: events on the way to also
    note when they arrived (``seen``: step -> block id -> ``time.perf_counter``), e.g.
    ``("placement",)``, the reservation committed (what a Ray placement group's ready means)."""

    def __init__(self, steps: tuple[str, ...] = ()) -> None:
        self.done: dict[str, tuple[str, float, dict[str, Any]]] = {}
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.steps = steps
        self.seen: dict[str, dict[str, float]] = {step: {} for step in steps}

    async def attach(self, bus: Any) -> None:
        from ..bus import subjects

        async def on_terminal(msg: Any) -> None:
            bid, kind = msg.subject.split(".")[2], msg.subject.rsplit(".", 1)[1]
            if bid in self.done:
                return
            data: dict[str, Any] = {}
            with contextlib.suppress(Exception):
                data = msgspec.json.decode(msg.data).get("data") or {}
            self.done[bid] = (kind, time.perf_counter(), data)
            fut = self.waiting.pop(bid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

        async def on_step(msg: Any) -> None:
            bid, step = msg.subject.split(".")[2], msg.subject.rsplit(".", 1)[1]
            self.seen[step].setdefault(bid, time.perf_counter())

        for kind in TERMINAL:
            await bus.subscribe(subjects.block_event("*", kind), on_terminal)
        for step in self.steps:
            await bus.subscribe(subjects.block_event("*", step), on_step)
        await bus.nc.flush()

    async def wait(self, bid: str, timeout: float) -> tuple[str, float, dict[str, Any]]:
        if bid not in self.done:
            fut = self.waiting[bid] = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(fut, timeout)
        return self.done[bid]


@dataclass
class Decided:
    """One block's outcome as the client saw it: ``ready`` or ``failed``, when it was created and
    when its outcome arrived (``time.perf_counter``)."""

    bid: str
    kind: str
    created: float
    done: float

    @property
    def seconds(self) -> float:
        return self.done - self.created


async def submit(
    client: Any, outcomes: Outcomes, tasks: list[Task], window: int = 1, timeout: float = 120.0,
    progress: Callable[[int, int], None] | None = None, offset: int = 0, total: int = 0,
) -> list[Decided]:
    """Create the tasks' blocks in order with at most ``window`` awaiting their outcome, and wait
    for every outcome; in the tasks' order. The creates started in one turn of the event loop go
    to the bus together (``Bus.emit_together``: one batch, in order). Raises ``LiveError`` on a
    rejected spec or a block with no outcome within ``timeout`` seconds."""
    room = asyncio.Semaphore(max(1, window))
    total = total or len(tasks)

    async def one(i: int, t: Task) -> Decided:
        try:
            t0 = time.perf_counter()
            req = await client.create(block_spec(t))
            try:
                kind, at, data = await outcomes.wait(req.bid, timeout)
            except TimeoutError:
                raise LiveError(f"block {req.bid} ({offset + i + 1} of {total}) had no outcome within {timeout:g} s") from None
            if kind == "rejected":  # the parser refused the spec: the replay's fault, not a task that fits nowhere
                raise LiveError(f"block {req.bid} was rejected: {data.get('errors') or data}")
            if progress is not None and (offset + i + 1) % 500 == 0:
                progress(offset + i + 1, total)
            return Decided(req.bid, kind, t0, at)
        finally:
            room.release()

    running: list[asyncio.Task[Decided]] = []
    try:
        for i, t in enumerate(tasks):
            await room.acquire()
            if any(r.done() and not r.cancelled() and r.exception() is not None for r in running[-max(1, window):]):
                break  # one failed: submit no more (gather raises it)
            running.append(asyncio.ensure_future(one(i, t)))
        return list(await asyncio.gather(*running))
    finally:
        for task in running:
            task.cancel()


async def read_back(client: Any, bids: list[str]) -> dict[str, tuple[str, list[str]]]:
    """Block id -> (node, GPUs) of its instance, from the state store (in chunks of round trips)."""
    out: dict[str, tuple[str, list[str]]] = {}
    step = 256
    for i in range(0, len(bids), step):
        chunk = bids[i:i + step]
        for bid, insts in zip(chunk, await asyncio.gather(*(client.store.instances(b) for b in chunk)), strict=True):
            for rec in insts.values():
                out[bid] = (str(rec["node"]), [str(g) for g in rec.get("gpus") or []])
    return out


async def replay_live(
    client: Any, nodes: list[Node], tasks: list[Task], policy: str = "builtin:fgd", seed: int = 42, ratio: float = 1.3,
    sample_nodes: int = 0, workload: str = "", progress: Callable[[int, int], None] | None = None,
    timeout: float = 120.0, window: int = 1,
) -> Result:
    """Replay through the system ``client`` is connected to (see the module's docstring). The
    system must hold no cluster yet: the replay's blocks hold their capacity for good, and the
    gateway must have no other cluster to choose."""
    if await client.store.clusters():
        raise LiveError("the system already has clusters: a live replay needs one of its own (its blocks are never "
                        "deleted, and its cluster must be the only one the gateway can choose); start a fresh "
                        "`blocks up --data-dir DIR`, or stop `blocks up` and let the command start its own servers")
    st = setup(nodes, tasks, policy, seed, ratio, sample_nodes)
    nodes = [n.model_copy(update={"cluster": CLUSTER}) for n in nodes]
    for comp in components(st):
        await client.add_component(comp)
    await client.import_nodes(Cluster(id=CLUSTER), nodes)
    outcomes = Outcomes()
    await outcomes.attach(client.bus)
    res = Result(st.uri, seed, workload, len(nodes), st.cluster_milli // UNITS, ratio, sample_nodes, mode="live")
    # the workers' start-up is in the first block's time: alone, and the time measured from its outcome
    first = await submit(client, outcomes, st.pods[:1], 1, timeout)
    rest = await submit(client, outcomes, st.pods[1:], window, timeout, progress, offset=1, total=len(st.pods))
    res.latencies = [d.seconds for d in rest]
    res.seconds = (max(d.done for d in rest) if rest else first[0].done) - first[0].done
    res.timed_blocks = len(st.pods) - 1  # the blocks decided within ``seconds`` (all but the first)
    placed = await read_back(client, [block_id(t) for t in st.pods])
    ledger = Ledger(nodes, st, res)
    for t in st.pods:
        ledger.add(t, placed.get(block_id(t)))
    ledger.close()
    # the node hashes the reservation script wrote must hold what the read-back placements add up to
    views = await client.store.read_nodes(CLUSTER, [n.id for n in nodes])
    held, counted = held_milli(views), held_milli(ledger.views)
    if held != counted:
        raise LiveMismatch(f"the nodes hold {held} thousandths of GPU compute, the placements read back {counted}")
    return res
