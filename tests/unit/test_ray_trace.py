"""The Ray side of ``bench/trace_vs_ray.py``: the trace's inventory as Ray custom resources and a
task as its placement group's bundle (pure; the run itself is tests/integration/test_trace_vs_ray.py)."""

from __future__ import annotations

from bench import ray_trace


def test_the_inventory_is_summed_per_pool_and_per_gpu_model() -> None:
    got = ray_trace.pools([(64000, 262144, 8, "V100M16"), (32000, 131072, 2, "T4"), (96000, 393216, 0, ""),
                           (64000, 262144, 4, "V100M16")])
    assert got == {"t_cpu": 256000, "t_mem": 1048576, "t_gpu": 14, "t_model_V100M16": 12, "t_model_T4": 2}


def test_a_bundle_asks_the_task_s_shape() -> None:
    # whole GPUs, any model
    assert ray_trace.bundle((8000, 30000, 2, 1000, ())) == {"t_cpu": 8000, "t_mem": 30000, "t_gpu": 2.0}
    # a GPU share is a fraction of one, and of its model's pool when the model is constrained
    assert ray_trace.bundle((4000, 1000, 1, 460, ("T4", "P100"))) == {"t_cpu": 4000, "t_mem": 1000, "t_gpu": 0.46,
                                                                      "t_model_T4": 0.46}
    # CPU-only: no GPU pool, no zero amounts (Ray refuses them)
    assert ray_trace.bundle((2000, 0, 0, 0, ())) == {"t_cpu": 2000}
