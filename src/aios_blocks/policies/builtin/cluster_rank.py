"""Built-in clusterAllocator: rank candidates by feasibility, pick the best dry_run score."""

from __future__ import annotations

from typing import Any

from ...schemas.policy_io import as_int
from ...schemas.records import ClusterEntry, JSONObject, PolicyInput
from ...settings import load as load_settings


def default_candidates() -> int:
    """Candidates kept by default (``AIOS_MAX_CANDIDATES``, read when asked; ``maxCandidates``
    overrides; 0 = every cluster that passed the filter)."""
    return load_settings().max_candidates


def _free_gpus(entry: ClusterEntry) -> int:
    return int(entry.get("metrics", {}).get("gpus_free", 0))


def _affinity(entry: ClusterEntry) -> float:
    return float(entry.get("metrics", {}).get("affinity_score", 0.0))


class ClusterRankPolicy:
    """Seed-000 class shape.

    * ``selection``: candidates sorted by Preferred-affinity score, then free GPUs (most first);
      ``parameters.maxCandidates`` keeps only the top N (default 3, ``0`` = all). Like
      kube-scheduler's percentageOfNodesToScore: the clusters ranked below the first few are
      almost never chosen (post_dry_run prefers the same free capacity), yet each one would cost
      a dry_run command, its decision record and its result on the stream.
    * ``post_dry_run``: the highest feasibility score; ties go to the higher affinity score, then
      more free GPUs, then the smallest id.
    """

    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id = rule_id
        self.settings = settings
        self.parameters = parameters

    def eval(self, parameters: JSONObject, input_data: PolicyInput, context: Any) -> Any:
        params = {**self.parameters, **(parameters or {})}
        if input_data["action"] == "selection":
            ranked = sorted(input_data["filter_result"], key=lambda e: (-_affinity(e), -_free_gpus(e), e["cluster_id"]))
            limit = as_int(params.get("maxCandidates", default_candidates()) or 0)
            return {"clusters": ranked[:limit] if limit > 0 else ranked}
        if input_data["action"] == "post_dry_run":
            clusters = input_data["clusters"]
            return min(
                clusters, key=lambda e: (-e["score_data"]["score"], -_affinity(e), -_free_gpus(e), e["cluster_id"])
            )
        raise ValueError(f"unsupported action {input_data['action']!r}")

