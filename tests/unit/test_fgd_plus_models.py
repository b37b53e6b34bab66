"""``builtin:fgd-plus``'s model pressure (policies/builtin/fgd_plus.py, docs/trace.md): a task that
may use any GPU model keeps off the models that model-constrained work needs."""

from __future__ import annotations

from aios_blocks.policies.builtin.fgd_plus import FgdPlusPolicy, model_pressure

from .test_fgd_plus import _node, _pick, views_of

WHOLE = {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024}
#: 30 % of the tasks may only use T4s; the rest any model
T4_AND_ANY = [{"cpu": 1, "gpus": 1, "weight": 0.3, "gpuModels": ["T4"]}, {"cpu": 1, "gpus": 1, "weight": 0.7}]


def test_an_unconstrained_task_leaves_the_t4s_to_the_t4_only_work() -> None:
    # n-t4: 2 idle T4s; n-g2: 2 G2s but CPUs for one task (its second GPU is stranded either way).
    # FGD's one-task view sees n-g2 lose its last fitting slot and takes a T4; the T4s' pressure
    # (30 % of the demand against half the GPUs: 0.6 of the compute taken) sends it to n-g2.
    views = views_of([_node("n-t4", 2, 32, model="T4"), _node("n-g2", 2, 1.5)])
    for seed in range(4):
        assert _pick(views, WHOLE, False, T4_AND_ANY, seed=seed)["node_id"] == "n-g2"
        assert _pick(views, WHOLE, False, T4_AND_ANY, seed=seed, modelPressure=0)["node_id"] == "n-t4"
    # a T4-only task is not charged (it has no choice), and goes where it may
    t4_only = {**WHOLE, "gpuModels": ["T4"]}
    assert _pick(views, t4_only, False, T4_AND_ANY)["node_id"] == "n-t4"


def test_pressure_is_constrained_demand_share_over_supply_share_capped_at_one() -> None:
    assert model_pressure(T4_AND_ANY, {"T4": 2, "G2": 2}) == {"T4": 0.6}
    assert model_pressure(T4_AND_ANY, {"T4": 1, "G2": 3}) == {"T4": 1.0}  # 30 % asked of 25 %
    # a choice of models is split by their GPUs; a model absent from the cluster takes none
    both = [{"cpu": 1, "gpus": 2, "weight": 1.0, "gpuModels": ["V100M16", "V100M32", "A100"]}]
    assert model_pressure(both, {"V100M16": 1, "V100M32": 3, "G2": 4}) == {"V100M16": 1.0, "V100M32": 1.0}
    assert model_pressure([{"cpu": 1, "gpus": 1, "weight": 1.0}], {"G2": 8}) == {}


def test_no_constrained_shape_means_no_pressure_whatever_the_parameter() -> None:
    policy = FgdPlusPolicy("resourceAllocator", {}, {"workload": [{"cpu": 1, "gpus": 1, "weight": 1.0}], "modelPressure": 5})
    assert policy.pressure_weight == 0
    policy = FgdPlusPolicy("resourceAllocator", {}, {"workload": T4_AND_ANY, "modelPressure": 0.5})
    assert policy.pressure_weight == 0.5
