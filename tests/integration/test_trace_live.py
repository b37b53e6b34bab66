"""``blocks trace replay --live`` against ``--in-process`` (docs/trace.md "Same decisions"): the
same sample of the default GPU trace, placed through the running system (real NATS JetStream,
Redis and workers) and by the placement code alone, gives the same figures and puts every block
on the same node and GPUs, for three seeds, with the system's rebalancer looking often (the replay's blocks
are never moved: ``live.block_spec``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aios_blocks.trace import live
from aios_blocks.trace import replay as rp
from aios_blocks.trace.inventory import parse_nodes
from aios_blocks.trace.workload import load_tasks

from .conftest import System

TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "openb-2023"
#: the first nodes of the trace's node list (P100, T4 and others): ~100 blocks at 130 %
NODES = 24


def _sample() -> tuple[list, list]:
    lines = (TRACE / "openb_node_list_gpu_node.csv").read_text(encoding="utf-8").splitlines()
    nodes = parse_nodes("\n".join(lines[: NODES + 1]), "trace", "csv")
    return nodes, load_tasks(TRACE / "openb_pod_list_default.csv")


@pytest.fixture
def busy_rebalancer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The system's rebalancer (``blocks up`` runs one) looks every half second, not every 10 s, with
    no cooldown: a replay block it could move is moved while the replay runs (fragmentation above
    AIOS_REBALANCE_FRAG_THRESHOLD), not only when a slow run happens to span a tick. Requested
    before ``system``, whose workers take the environment."""
    monkeypatch.setenv("AIOS_REBALANCE_INTERVAL_S", "0.5")
    monkeypatch.setenv("AIOS_REBALANCE_COOLDOWN_S", "0")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [42, 43, 44])
async def test_live_and_in_process_make_the_same_decisions(busy_rebalancer: None, system: System, seed: int) -> None:
    nodes, tasks = _sample()
    planned = await rp.replay(nodes, tasks, "fgd", seed, 1.3, 0, "default")
    got = await live.replay_live(system.client, nodes, tasks, "fgd", seed, 1.3, 0, "default", timeout=120)
    a, b = planned.as_dict(), got.as_dict()
    assert b["mode"] == "live" and a["mode"] == "in-process"
    assert set(a) == set(b)  # --json writes the same keys in both modes
    assert 0 < b["placed"] < b["blocks"]  # some tasks fit nowhere: the replay went on past them
    for key in ("alloc_at_100", "alloc_at_130", "frag_at_100", "frag_at_130", "blocks", "placed", "failures",
                "alloc_curve", "frag_curve", "arrived_end"):
        assert a[key] == b[key], key
    # every block on the same node and GPUs (read back from the state store, not the replay's own)
    assert got.placements == planned.placements
    assert len(got.latencies) == b["blocks"] - 1 and b["p50_ms"] > 0
    # the trace's QoS class is the block's label, in the IR the system stored
    pods = rp.setup(nodes, tasks, "fgd", seed, 1.3, 0).pods
    t = next(p for p in pods if p.qos)
    block = await system.client.store.get_block(rp.block_id(t))
    assert block is not None and block["ir"]["labels"] == {"qos": t.qos}


async def test_a_system_with_a_cluster_is_refused(system: System) -> None:
    """Its blocks would stay, and the gateway could choose the other cluster: said, nothing submitted."""
    await system.client.add_sim_cluster("other", nodes=1, gpus=1)
    nodes, tasks = _sample()
    with pytest.raises(live.LiveError, match="already has clusters"):
        await live.replay_live(system.client, nodes, tasks, "fgd", 42)
    assert "trace" not in await system.client.store.clusters()


@pytest.mark.timeout(600)
async def test_a_window_of_creates_in_flight_decides_every_block_and_adds_up(system: System) -> None:
    """``window=8``: the creates pipelined (docs/trace.md "Live vs Ray": the order of the plans, so
    the decisions, may then differ from --in-process); every block gets an outcome and what is
    read back adds up to the node hashes (``replay_live`` raises ``LiveMismatch`` otherwise)."""
    nodes, tasks = _sample()
    got = await live.replay_live(system.client, nodes, tasks, "fgd", 42, 1.3, 0, "default", timeout=120, window=8)
    pods = rp.setup(nodes, tasks, "fgd", 42, 1.3, 0).pods
    assert got.blocks == len(pods) and len(got.latencies) == len(pods) - 1
    assert 0 < got.placed < got.blocks and len(got.placements) == got.placed
    placed = await live.read_back(system.client, [rp.block_id(t) for t in pods])
    assert {b: (n, tuple(g)) for b, (n, g) in placed.items()} == got.placements


async def test_its_own_system_writes_no_log_line_on_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    # `blocks trace replay --live` without a running system printed the stream's creation as log lines
    # among its figures on stdout ("[info ] stream.created stream=AIOS", four of them)
    said: list[str] = []
    async with live.own_system(said.append) as (_, _, data):
        assert (data / "endpoints.json").exists()
    out = capfd.readouterr().out
    assert "stream.created" not in out and out == "", out
    assert said and said[0].startswith("started NATS, Redis and the workers")
