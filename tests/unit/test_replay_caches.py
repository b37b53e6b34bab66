"""The caches that cut the in-process replay's CPU (docs/trace.md "Speed"): each must give what
the computation it saves gives, after the state it was filled from has changed.

* ``FillWorkload``'s figure kept per (model, tasks of each CPU figure that fit, free compute):
  equal to the measure computed afresh for every CPU, however the CPUs seen before fell;
* ``capacity.healthy_set`` / ``capacity.unhealthy``: an inventory view's healthy set handed to
  a policy only while it is that view's current one;
* ``runtime.fingerprint``: rules whose settings or parameters differ get their own instances.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.fgd_plus import FillWorkload
from aios_blocks.policies.runtime import PolicyRuntime, fingerprint
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.replay import views_of

#: shapes whose CPU figures make close thresholds (3.152 / 4.0 / 4.152, 11.9 / 11.908), shares
#: of several sizes, a model-limited shape and CPU-only tasks, as the trace's typical shapes have
SHAPES: list[dict[str, Any]] = [
    {"cpu": 3.152, "gpus": 1, "gpuShare": 0.25, "weight": 0.2},
    {"cpu": 4.0, "gpus": 1, "gpuShare": 0.5, "weight": 0.15},
    {"cpu": 4.152, "gpus": 1, "weight": 0.2},
    {"cpu": 11.9, "gpus": 2, "weight": 0.1},
    {"cpu": 11.908, "gpus": 1, "gpuShare": 0.3, "weight": 0.1},
    {"cpu": 6.0, "gpus": 1, "gpuModels": ["T4"], "weight": 0.05},
    {"cpu": 8.0, "gpus": 8, "weight": 0.05},
    {"cpu": 2.0, "gpus": 0, "weight": 0.15},
]


def _fresh(model: str, cpu: float, left: tuple[int, ...]) -> float:
    """The measure computed with no memo at all (a new instance, its own computation)."""
    wl = FillWorkload(SHAPES)
    return wl._measure(model, cpu + 1e-9, left, sum(left)) if sum(left) else 0.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_fill_measure_kept_per_cpu_level_equals_a_fresh_one_for_every_cpu(seed: int) -> None:
    """CPUs on both sides of each shape's thresholds (multiples of its CPU), GPUs in any order:
    a level key that merged two CPUs giving different counts, or left out the model or the
    GPUs, answers the first one's figure for the second and fails here."""
    rng = random.Random(seed)
    wl = FillWorkload(SHAPES)
    cpus = sorted({s["cpu"] for s in SHAPES})
    checked = 0
    for _ in range(3000):
        c = rng.choice(cpus) * rng.randint(1, 9)
        cpu = max(0.0, c + rng.choice([-1e-6, -1e-10, 0.0, 1e-10, 1e-6, rng.uniform(-2, 2)]))
        left = tuple(rng.choice([0, 0, 1000, 1000, 1000, 500, 750, 250, 700, 100, 30]) for _ in range(rng.choice([1, 2, 4, 8])))
        model = rng.choice(["T4", "G2", "V100M16"])
        assert wl.frag(model, cpu, left) == _fresh(model, cpu, left), (model, cpu, left)
        checked += 1
    assert checked == 3000
    assert len(wl._by_level) < len(wl._memo)  # the level key did merge CPUs: it was exercised


def test_two_cpus_between_the_same_thresholds_share_a_figure_and_across_one_do_not() -> None:
    wl = FillWorkload(SHAPES)
    left = (1000, 1000, 1000, 1000)
    a, b = wl.frag("G2", 8.31, left), wl.frag("G2", 8.305, left)  # both: 2 x 4.152 <= cpu < 3 x 3.152
    assert a == b == _fresh("G2", 8.31, left)
    below = wl.frag("G2", 8.303, left)  # just under 2 x 4.152: one task of 4.152 fewer
    assert below == _fresh("G2", 8.303, left) and below != a


def _nodes(n: int) -> capacity.Nodes:
    return views_of([Node(id=f"n{i}", cluster="c", cpu=32, memory=65536,
                          gpus=[Gpu(id=f"n{i}-g0", model="G2", memory=16384)]) for i in range(n)])


def _unhealthy_view(view: dict[str, Any]) -> dict[str, Any]:
    node = capacity.copy_node(view)
    node["healthy"] = False
    return node


def test_the_healthy_set_is_the_views_own_only_while_it_is_current() -> None:
    nodes = _nodes(6)
    ids = capacity.healthy_ids(nodes)
    healthy = capacity.healthy_set(nodes, ids)
    assert healthy == set(ids) and capacity.unhealthy(nodes, healthy) == set()
    nodes["n3"] = _unhealthy_view(nodes["n3"])  # the view changed after the set was handed out
    # the old list is not the view's healthy nodes now: its own set, n3 in it as the list says
    assert capacity.healthy_set(nodes, ids) == set(ids)
    # the old set, no longer current: what is not in it is computed, not assumed empty
    assert capacity.unhealthy(nodes, set(ids) - {"n3"}) == {"n3"}
    now = capacity.healthy_ids(nodes)
    assert "n3" not in now
    current = capacity.healthy_set(nodes, now)
    assert current == set(now) and capacity.unhealthy(nodes, current) == {"n3"}
    nodes["n6"] = nodes["n0"] | {"node_id": "n6"}  # a node added: a healthy set that misses it
    assert capacity.unhealthy(nodes, current) == {"n3", "n6"}
    # a plain dict: no memo, the plain set operations
    plain = dict(nodes)
    assert capacity.healthy_set(plain, now) == set(now) and capacity.unhealthy(plain, set(now)) == {"n3", "n6"}


def test_the_view_with_every_node_healthy_skips_none_and_one_fewer_skips_it() -> None:
    nodes = _nodes(4)
    healthy = capacity.healthy_set(nodes, capacity.healthy_ids(nodes))
    assert capacity.unhealthy(nodes, healthy) == set()
    fewer = set(healthy) - {"n1"}  # not the view's set: its own difference
    assert capacity.unhealthy(nodes, fewer) == {"n1"}
    same_size = {"n0", "n1", "n2", "x"}  # as many ids as nodes, not the view's set
    assert capacity.unhealthy(nodes, same_size) == {"n3"}
    # the view's set from before a node was replaced by another: as many ids, no longer current
    del nodes["n3"]
    nodes["n7"] = nodes["n0"] | {"node_id": "n7"}
    assert capacity.unhealthy(nodes, healthy) == {"n7"}


def test_rules_with_other_settings_or_parameters_get_their_own_policy_instance() -> None:
    async def go() -> None:
        rt = PolicyRuntime(lookup=None)
        base = {"name": "resourceAllocator", "policyRuleURI": "builtin:fgd",
                "settings": {"gpuSharing": False}, "parameters": {"seed": 1, "workload": SHAPES}}
        first, _, _ = await rt.instance(base, "b1")
        again, _, _ = await rt.instance({**base, "parameters": {"seed": 1, "workload": [dict(s) for s in SHAPES]}}, "b2")
        assert again is first  # equal parameters, other objects: the same instance (shareable)
        for other in ({"seed": 2, "workload": SHAPES}, {"seed": 1.0, "workload": SHAPES}, {"seed": True, "workload": SHAPES},
                      {"seed": "1", "workload": SHAPES}, {"seed": 1, "workload": SHAPES[:-1]},
                      {"seed": 1, "workload": [{**SHAPES[0], "cpu": 3.1520000000000001 + 1e-12}, *SHAPES[1:]]}):
            inst, _, _ = await rt.instance({**base, "parameters": other}, "b3")
            assert inst is not first, other
        sharing, _, _ = await rt.instance({**base, "settings": {"gpuSharing": True}}, "b4")
        assert sharing is not first and sharing.share

    import asyncio

    asyncio.run(go())


def test_the_fingerprint_keeps_apart_what_repr_does() -> None:
    values = [1, 1.0, True, "1", None, float("nan"), 0.0, -0.0, {"a": 1}, {"a": 1.0}, {1: 1}, {"1": 1},
              [1, 2], [2, 1], {"a": 1, "b": 2}, {"b": 2, "a": 1}]
    prints = [fingerprint(v) for v in values]
    assert len(set(prints)) == len(values)
    assert fingerprint({"x": {1, 2}}) == fingerprint({"x": {1, 2}})
    assert isinstance(fingerprint({"x": object()}), str)  # cannot encode: its repr
