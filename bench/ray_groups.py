"""Ray placement groups alone, printed as JSON: the Ray side of ``bench/peer.py`` (10 x 100 x 8
simulated GPUs as a custom resource, 1-bundle groups), importing nothing of aios_blocks so it runs
in a venv that has only ray (``bench/ab_targets.sh`` with ``RAY_PYTHON``).

    python bench/ray_groups.py LAT_N BURST_N
"""

from __future__ import annotations

import json
import sys
import time

CLUSTERS, NODES, GPUS = 10, 100, 8


def ray_figures(lat_n: int, burst_n: int) -> tuple[list[float], float]:
    """Create->ready latencies of ``lat_n`` groups one at a time (s), and groups/s of a burst."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(num_cpus=2, resources={"sim_gpu": CLUSTERS * NODES * GPUS}, include_dashboard=False,
             object_store_memory=80 * 1024**2, log_to_driver=False, logging_level="ERROR")
    try:
        for _ in range(3):  # warm
            pg = placement_group([{"sim_gpu": 1}], strategy="PACK")
            ray.get(pg.ready(), timeout=60)
            remove_placement_group(pg)
        lat = []
        for _ in range(lat_n):
            t = time.perf_counter()
            pg = placement_group([{"sim_gpu": 1}], strategy="PACK")
            ray.get(pg.ready(), timeout=60)
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        pgs = [placement_group([{"sim_gpu": 1}], strategy="PACK") for _ in range(burst_n)]
        ray.get([pg.ready() for pg in pgs], timeout=300)
        return lat, burst_n / (time.perf_counter() - t)
    finally:
        ray.shutdown()


def main() -> None:
    lat, rate = ray_figures(int(sys.argv[1]), int(sys.argv[2]))
    lat.sort()
    print(json.dumps({"p50_ms": lat[len(lat) // 2] * 1000, "groups_per_s": rate}))


if __name__ == "__main__":
    main()
