"""GPU topology end to end (issue 38, docs/topology.md): a simulated node registered with the
`nvlink-pairs-4` profile (`blocks node add --gpu-topology`) shows it in `blocks node get`; two
2-GPU blocks land on its two NVLink pairs (without the topology, the allocator's own order would
split a pair for one of them) and `blocks explain` says the tier each got and the best the node
had. Real NATS JetStream and Redis, real workers."""

from __future__ import annotations

import json

from .conftest import System
from .test_cli import blocks

PAIRS = [{"tp-n0-g0", "tp-n0-g1"}, {"tp-n0-g2", "tp-n0-g3"}]


async def test_two_2gpu_blocks_land_on_the_nvlink_pairs_and_explain_says_so(system: System) -> None:
    for args in (("cluster", "add", "tp"), ("node", "add", "tp-n0", "--cluster", "tp", "--gpu-topology", "nvlink-pairs-4")):
        r = blocks(system, *args)
        assert r.returncode == 0, r.stderr
    r = blocks(system, "node", "get", "tp-n0", "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert len(view["gpus"]) == 4 and view["topology"]["profile"] == "nvlink-pairs-4"
    r = blocks(system, "node", "get", "tp-n0")
    assert r.returncode == 0 and "profile nvlink-pairs-4" in r.stdout and "NV4" in r.stdout and "HOST_BRIDGE" in r.stdout, r.stdout

    got = []
    for bid in ("tp-x", "tp-b"):  # binpack alone gives tp-x GPUs 1,2 (its tie-break order)
        _, kind, env = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": bid,
                                                     "minInstances": 1, "maxInstances": 1, "resources": {"gpus": 2}})
        assert kind == "ready", env
        (inst,) = (await system.client.store.instances(bid)).values()
        got.append(set(inst["gpus"]))
        assert got[-1] in PAIRS, got
        r = blocks(system, "explain", bid, "--json")
        assert r.returncode == 0, r.stderr
        (placed,) = json.loads(r.stdout)["instances"].values()
        assert placed["topology"] == {"tier": "NVLINK", "best": "NVLINK"}, placed
        r = blocks(system, "explain", bid)
        assert "GPU link tier NVLINK (best the node had free: NVLINK)" in r.stdout, r.stdout
    assert sorted(got, key=sorted) == PAIRS, got
