"""Share prices (policies/builtin/share_prices.py) and fgd-plus's ``sharePacking`` on hand-built
nodes (docs/trace.md "Our policy", 5.): the cutting-stock dual of a share distribution, each
free amount's worth, and the GPU a share is placed on."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from aios_blocks.policies import capacity
from aios_blocks.policies.builtin.fgd_plus import FgdPlusPolicy
from aios_blocks.policies.builtin.share_prices import SharePrices, best_fill, dual_prices, simplex_max
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.replay import views_of

#: the default trace's share sizes (thousandths) with their frequencies among its tasks
DEFAULT_SHARES = {810: 0.141, 650: 0.029, 590: 0.009, 550: 0.009, 470: 0.092, 460: 0.015, 370: 0.006,
                  320: 0.037, 230: 0.015, 220: 0.005, 160: 0.007}


def test_simplex_finds_the_optimum_of_a_small_lp() -> None:
    # max 3x + 2y, x + y <= 4, x + 3y <= 6, x <= 3: the optimum is (3, 1)
    x = simplex_max([3, 2], [[1, 1], [1, 3], [1, 0]], [4, 6, 3])
    assert x == pytest.approx([3, 1])


def test_knapsack_counts_the_best_set_of_shares_in_each_free_amount() -> None:
    value, take = best_fill([320, 470], [1 / 3, 1 / 2], 1000)
    assert value[1000] == pytest.approx(1.0) and take[1000] in ([3, 0], [0, 2])
    assert value[530] == pytest.approx(0.5) and value[319] == 0 and value[800] == pytest.approx(5 / 6)


def _brute_force_bound(weights: dict[int, float]) -> float:
    """The cutting-stock LP's value for tiny size sets: every configuration priced at most 1, by
    trying every price grid point (multiples of 1/12) and keeping the feasible best."""
    sizes = sorted(weights)
    confs = [c for c in itertools.product(*(range(1000 // s + 1) for s in sizes))
             if sum(k * s for k, s in zip(c, sizes, strict=True)) <= 1000]
    best = 0.0
    for ys in itertools.product(*(range(13) for _ in sizes)):
        y = [v / 12 for v in ys]
        if all(sum(k * p for k, p in zip(c, y, strict=True)) <= 1 + 1e-9 for c in confs):
            best = max(best, sum(weights[s] * p for s, p in zip(sizes, y, strict=True)))
    return best


@pytest.mark.parametrize("weights", [{500: 1.0}, {810: 0.9, 160: 0.1}, {470: 0.5, 320: 0.5}, {650: 0.3, 320: 0.4, 230: 0.3}])
def test_dual_prices_are_feasible_and_optimal(weights: dict[int, float]) -> None:
    y = dual_prices(weights)
    sizes = sorted(y)
    value, _ = best_fill(sizes, [y[s] for s in sizes], 1000)
    assert value[1000] <= 1 + 1e-7  # no set of shares that fits on a GPU is priced above 1 GPU
    assert sum(weights[s] * y[s] for s in sizes) == pytest.approx(_brute_force_bound(weights), abs=1e-6)


def test_the_default_traces_prices() -> None:
    # 0.81 is worth a whole GPU, 0.47 half of one, 0.32 a third, a 0.16 nothing (the 0.81s'
    # leftovers have room for more of them than arrive)
    y = dual_prices(DEFAULT_SHARES)
    assert y[810] == pytest.approx(1) and y[470] == pytest.approx(0.5) and y[320] == pytest.approx(1 / 3)
    assert y[160] == pytest.approx(0) and y[650] == pytest.approx(2 / 3)


def test_loss_of_a_share_on_a_gpu() -> None:
    prices = SharePrices({470: 0.5, 320: 0.5})
    # a 0.32 on an idle GPU: three of them fill it, nothing lost
    assert prices.loss(1000, 320) == pytest.approx(0)
    # on a GPU holding a 0.47 (530 free): the 0.47 it was waiting for is shut out, 210 stay idle
    assert prices.loss(530, 320) == pytest.approx(0.5 - 1 / 3, abs=1e-6)
    # a 0.47 there completes it
    assert prices.loss(530, 470) == pytest.approx(0)
    # a size the workload lacks is priced as the largest size within it
    assert prices.price(400) == prices.price(320) and prices.loss(1000, 400) >= 0
    assert SharePrices.of_shapes([{"cpu": 1, "gpus": 1, "weight": 1}]) is None


def _node(nid: str, gpus: int) -> Node:
    return Node(id=nid, cluster="c", cpu=64, memory=262144,
                gpus=[Gpu(id=f"{nid}-g{i}", model="G2", memory=16384) for i in range(gpus)])


def _pick(views: dict[str, Any], needs: dict[str, Any], workload: list[dict[str, Any]], seed: int,
          **params: Any) -> tuple[str, list[str]]:
    policy = FgdPlusPolicy("resourceAllocator", {"gpuSharing": True}, {"seed": seed, "workload": workload, **params})
    out = policy.eval({}, {"action": "allocation", "payload": {
        "block": {"blockId": "b1", "resources": needs, "instances": {}, "maxInstances": 1},
        "cluster_metrics": {"nodes": views}, "healthy_nodes": sorted(views)}}, {})
    return out["node_id"], out["gpus"]


def test_a_share_does_not_spoil_the_gpu_another_size_would_fill() -> None:
    # n-used: a GPU holding a 0.47 (530 free) and an idle GPU; n-idle: two idle GPUs. A 0.32
    # on the 530 GPU leaves 210 that no share of the workload fits, and shuts out the 0.47 that
    # would complete it; FGD's measure (sharePacking 0) prefers it (the 530 GPU is already
    # fragment for whole-GPU tasks). With the prices it opens an idle GPU, where three 0.32s fit.
    def share(units: float) -> dict[str, Any]:
        return {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024, "gpuShare": units}

    views = views_of([_node("n-used", 2), _node("n-idle", 2)])
    node = capacity.copy_node(views["n-used"])
    capacity.take(node, ["n-used-g0"], share(0.47), True)
    views["n-used"] = node
    workload = [{"cpu": 1, "gpus": 1, "gpuShare": 0.47, "weight": 0.3},
                {"cpu": 1, "gpus": 1, "gpuShare": 0.32, "weight": 0.3}, {"cpu": 1, "gpus": 1, "weight": 0.4}]
    for seed in range(4):
        assert _pick(views, share(0.32), workload, seed, sharePacking=0) == ("n-used", ["n-used-g0"])
        assert _pick(views, share(0.32), workload, seed) != ("n-used", ["n-used-g0"])
        # the 0.47 still completes the GPU with 530 free
        assert _pick(views, share(0.47), workload, seed) == ("n-used", ["n-used-g0"])


def test_what_a_share_leaves_is_worth_what_the_nodes_cpus_can_still_take() -> None:
    # 0.47s ask 8 CPUs, 0.32s 4: a 0.47 on an idle GPU of a node left with 4 CPUs leaves 530
    # that no 0.47 can take (only a 0.32: worth 1/3, not 1/2), so it loses 1/6 of a GPU
    prices = SharePrices({470: 0.5, 320: 0.5}, {470: 8.0, 320: 4.0})
    assert prices.loss(1000, 470) == pytest.approx(0)
    assert prices.loss(1000, 470, cpu_after=16) == pytest.approx(0)
    assert prices.loss(1000, 470, cpu_after=4) == pytest.approx(1 - 1 / 3 - 0.5, abs=1e-6)
    # with CPUs for no share at all, what it leaves is worth nothing
    assert prices.loss(1000, 470, cpu_after=2) == pytest.approx(0.5, abs=1e-6)
    # what the GPU had free is worth what the node's CPUs could take before: on a node with 6
    # CPUs a GPU with 530 free waits for no 0.47, so a 0.32 there loses nothing
    assert prices.loss(530, 320, cpu_after=2) == pytest.approx(0.5 - 1 / 3, abs=1e-6)
    assert prices.loss(530, 320, cpu_after=2, cpu_before=6) == pytest.approx(0)
    assert SharePrices.of_shapes([{"cpu": 8, "gpus": 1, "gpuShare": 0.47, "weight": 1},
                                  {"cpu": 6, "gpus": 1, "gpuShare": 0.47, "weight": 1}], with_cpus=True).cpus == {470: 6.0}


def test_the_share_space_a_tasks_cpus_strand_on_its_node() -> None:
    # a node's partly used GPUs with 530 and 210 free: going from 10 CPUs to 6 leaves no CPUs
    # for a 0.47 (8), so the 530 is worth a 0.32 (1/3) instead of a 0.47 (1/2); the 210 fits
    # neither size either way. Below 4 CPUs nothing fits: the 530 is worth nothing
    prices = SharePrices({470: 0.5, 320: 0.5}, {470: 8.0, 320: 4.0})
    assert prices.stranded((530, 210, 1000, 0), 10, 6) == pytest.approx(0.5 - 1 / 3, abs=1e-6)
    assert prices.stranded((530, 210), 10, 2) == pytest.approx(0.5, abs=1e-6)
    assert prices.stranded((530, 210), 10, 8) == 0 and prices.stranded((1000, 0), 10, 2) == 0
    assert prices.stranded((530, 530), 10, 6, skip=0) == pytest.approx(1 / 6, abs=1e-6)


def test_a_task_pays_for_the_share_space_its_cpus_strand() -> None:
    # n-a: a GPU holding a 0.47 (530 free) and 18 CPUs (10 left); n-b: a GPU held whole and 8
    # CPUs (4 left). A CPU-only task of 4 CPUs on n-a leaves 6: no 0.47 can take the 530 any
    # more. leftoverCpu charges that (1/6 of a GPU x 1000 x the weight) to n-a's score, not to n-b's
    workload = [{"cpu": 8, "gpus": 1, "gpuShare": 0.47, "weight": 0.3}, {"cpu": 2, "gpus": 1, "gpuShare": 0.32, "weight": 0.2},
                {"cpu": 4, "gpus": 1, "weight": 0.3}, {"cpu": 8, "gpus": 0, "weight": 0.2}]
    views = views_of([Node(id="n-a", cluster="c", cpu=18, memory=262144, gpus=[Gpu(id=f"n-a-g{i}", model="G2", memory=16384) for i in range(2)]),
                      Node(id="n-b", cluster="c", cpu=8, memory=262144, gpus=[Gpu(id=f"n-b-g{i}", model="G2", memory=16384) for i in range(2)])])
    for nid, gpu, needs, share in (("n-a", "n-a-g0", {"gpus": 1, "gpuMemory": 0, "cpu": 8, "memory": 1024, "gpuShare": 0.47}, True),
                                   ("n-b", "n-b-g0", {"gpus": 1, "gpuMemory": 0, "cpu": 4, "memory": 1024}, False)):
        node = capacity.copy_node(views[nid])
        capacity.take(node, [gpu], needs, share)
        views[nid] = node
    task = {"gpus": 0, "gpuMemory": 0, "cpu": 4, "memory": 1024}

    def scores(**params: Any) -> dict[str, float]:
        policy = FgdPlusPolicy("resourceAllocator", {"gpuSharing": True}, {"seed": 1, "workload": workload, **params})
        return {nid: policy._score_view(v, [], task, 0, 0)[0][0] for nid, v in views.items()}

    plain, charged = scores(leftoverCpu=0), scores(leftoverCpu=2)
    assert charged["n-a"] - plain["n-a"] == pytest.approx(2 * 1000 * (0.5 - 1 / 3), abs=1e-3)
    assert charged["n-b"] == plain["n-b"]


def test_a_share_goes_where_the_cpus_left_can_still_fill_its_gpu() -> None:
    # a 0.47 asking 2 CPUs; the workload's 0.47s ask 8, its 0.32s 4. On n-a (6 CPUs) the 0.53 it
    # leaves would keep 4 CPUs: no 0.47 can complete that GPU, only a 0.32 (1/6 of a GPU lost).
    # On n-b (40 CPUs) a 0.47 can. FGD's measure descends on n-a (its GPUs are already fragment
    # for the 8-CPU 0.47s); with the CPUs in the prices (shareCpu, the default) it takes n-b
    workload = [{"cpu": 8, "gpus": 1, "gpuShare": 0.47, "weight": 0.5}, {"cpu": 4, "gpus": 1, "gpuShare": 0.32, "weight": 0.5}]
    views = views_of([Node(id=nid, cluster="c", cpu=cpu, memory=262144,
                           gpus=[Gpu(id=f"{nid}-g{i}", model="G2", memory=16384) for i in range(2)])
                      for nid, cpu in (("n-a", 6), ("n-b", 40))])
    task = {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 1024, "gpuShare": 0.47}
    for seed in range(4):
        assert _pick(views, task, workload, seed, shareCpu=0, leftoverCpu=0)[0] == "n-a"
        assert _pick(views, task, workload, seed, leftoverCpu=0)[0] == "n-b"
        assert _pick(views, task, workload, seed)[0] == "n-b"


def test_a_sizes_cpus_are_the_fewest_or_a_quantile_of_its_shapes() -> None:
    shapes = [{"cpu": 8, "gpus": 1, "gpuShare": 0.47, "weight": 0.4}, {"cpu": 12, "gpus": 1, "gpuShare": 0.47, "weight": 0.6},
              {"cpu": 4, "gpus": 1, "gpuShare": 0.32, "weight": 1}]
    assert SharePrices.of_shapes(shapes, with_cpus=True).cpus == {470: 8.0, 320: 4.0}
    assert SharePrices.of_shapes(shapes, with_cpus=True, quantile=0.5).cpus == {470: 12.0, 320: 4.0}
    assert SharePrices.of_shapes(shapes, with_cpus=True, quantile=0.4).cpus == {470: 8.0, 320: 4.0}
    assert SharePrices.of_shapes(shapes).cpus == {470: 0.0, 320: 0.0}


def test_a_share_is_not_charged_for_space_the_nodes_cpus_had_already_left_to_no_size() -> None:
    # n-a: a GPU holding a 0.47 (530 free) with 6 CPUs free: no 0.47 (8 CPUs) could take the 530
    # before the 0.32 (4 CPUs) either; it was worth a 0.32 (1/3), which the 0.32 takes: nothing
    # lost. By default (shareCpu 2) the price sees that; shareCpu 1 charges the 0.32 for the
    # 0.47 that could never have come (1/2 - 1/3 of a GPU x sharePacking x 1000)
    workload = [{"cpu": 8, "gpus": 1, "gpuShare": 0.47, "weight": 0.5}, {"cpu": 4, "gpus": 1, "gpuShare": 0.32, "weight": 0.5}]
    views = views_of([Node(id="n-a", cluster="c", cpu=14, memory=262144, gpus=[Gpu(id="n-a-g0", model="G2", memory=16384)])])
    node = capacity.copy_node(views["n-a"])
    capacity.take(node, ["n-a-g0"], {"gpus": 1, "gpuMemory": 0, "cpu": 8, "memory": 1024, "gpuShare": 0.47}, True)
    task = {"gpus": 1, "gpuMemory": 0, "cpu": 4, "memory": 1024, "gpuShare": 0.32}

    def score(**params: Any) -> float:
        policy = FgdPlusPolicy("resourceAllocator", {"gpuSharing": True}, {"seed": 1, "workload": workload, **params})
        usable = capacity.node_fits(node, task, True)
        assert usable
        return float(policy._score_view(node, usable, task, 320, 1)[0][0])

    assert score(shareCpu=1) - score() == pytest.approx(10 * 1000 * (0.5 - 1 / 3), abs=1e-2)
    assert score() == score(shareCpu=2)


def test_a_loss_is_computed_on_its_first_use_only_and_as_the_whole_table_was(monkeypatch: pytest.MonkeyPatch) -> None:
    # a node state new to a shape asks one free amount's loss: the entry, not the 1,001 of the
    # table (each a _loss call: ~1 ms per new table on a live create's path)
    prices = SharePrices(DEFAULT_SHARES, cpus={810: 8, 470: 4, 320: 2})
    calls: list[tuple[int, int]] = []
    plain = SharePrices._loss

    def counted(self: SharePrices, free: int, units: int, after: list[float], before: list[float]) -> float:
        calls.append((free, units))
        return plain(self, free, units, after, before)

    monkeypatch.setattr(SharePrices, "_loss", counted)
    first = prices.loss(530, 320, cpu_after=3.0, cpu_before=9.0)
    assert calls == [(530, 320)]
    assert prices.loss(530, 320, cpu_after=3.0, cpu_before=9.0) == first and calls == [(530, 320)]
    assert prices.loss(200, 320, cpu_after=3.0, cpu_before=9.0) == 0.0 and calls == [(530, 320)]  # under the share
    # every entry as the whole table computed it
    for cpu_after, cpu_before in ((3.0, 9.0), (None, None), (1.0, 4.0)):
        phi, had = prices.phi_at(prices.level(cpu_after)), prices.phi_at(prices.level(cpu_before))
        for units in (320, 470, 400):
            table = [plain(prices, h, units, phi, had) if h >= units else 0.0 for h in range(1001)]
            assert [prices.loss(h, units, cpu_after, cpu_before) for h in range(1001)] == table
            assert prices.loss(1500, units, cpu_after, cpu_before) == table[1000]


def test_each_free_amounts_worth_is_the_knapsack_value_without_its_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # phi and each CPU level's phi: best_fill's value to the last bit (random prices with ties
    # and near-ties, sizes in any order), computed without best_fill's counts (a list copied per
    # thousandth, ~1.6 ms a level on a live create's path): no best_fill call for a level
    import random

    from aios_blocks.policies.builtin import share_prices as sp

    rng = random.Random(3)
    for _ in range(40):
        sizes = rng.sample(range(50, 1000, 10), rng.randint(1, 8))
        prices = [rng.choice([0.0, 0.25, 1 / 3, 0.5, 0.5 + 1e-10, rng.random()]) for _ in sizes]
        for order in (sorted(range(len(sizes)), key=lambda k: sizes[k]), list(range(len(sizes)))):
            s, p = [sizes[k] for k in order], [prices[k] for k in order]
            assert sp.best_value(s, p, 1000) == best_fill(s, p, 1000)[0]
    shares = SharePrices(DEFAULT_SHARES, cpus={810: 8, 650: 6, 470: 4, 320: 2, 230: 1})
    calls: list[int] = []
    plain = sp.best_fill
    monkeypatch.setattr(sp, "best_fill", lambda *a: calls.append(1) or plain(*a))
    for level in range(len(shares.levels) + 1):
        within = [s for s in shares._sizes if level and shares.cpus[s] <= shares.levels[level - 1]]
        assert shares.phi_at(level) == plain(within, [shares.prices[s] for s in within], 1000)[0]
    assert calls == []
