"""Built-in resourceAllocators: bin-pack and spread, GPU-memory aware.

Nomad-shaped: feasibility (``capacity.node_fits``) then a rank (``_rank``), then the max-score
pick. They rank the nodes of the payload, which for a large cluster is a seeded sample holding
enough feasible nodes (``policies.sampling``, Nomad's limit iterator). GPU sharing happens only when the rule's settings say ``gpuSharing: true``; then each
instance takes ``gpuMemory`` MiB of a GPU instead of the whole GPU.
"""

from __future__ import annotations

from typing import Any

from ...schemas.records import (
    DryRunAnswer,
    GpuView,
    JSONObject,
    Needs,
    NodeAffinity,
    NodeView,
    Placement,
    PlacementPayload,
    PolicyBlock,
    PolicyInput,
    ScaleDownAnswer,
)
from .. import affinity, capacity, contract


def string_hash(s: str) -> int:
    """Starlark's ``hash()`` of a string (Java's ``String.hashCode``), so a Starlark twin of these
    policies can break ties exactly as they do."""
    h = 0
    for ch in s:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def tie_seed(block: PolicyBlock) -> str:
    """What equal GPUs are ordered by, per request: the block and how many instances it has."""
    return f"{block.get('blockId', '')}:{len(block.get('instances') or {})}"


class _ResourceAllocator:
    mode = "binpack"
    #: one instance may serve every block of a rule (``PolicyRuntime.instance``): what an instance
    #: keeps is derived from its settings and parameters (workload tables, memos keyed by node
    #: state and request), never a block's own state
    shareable = True

    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id = rule_id
        self.settings = settings or {}
        self.parameters = parameters or {}

    @property
    def share(self) -> bool:
        return bool(self.settings.get("gpuSharing", False))

    def eval(self, parameters: JSONObject, input_data: PolicyInput, context: Any) -> Placement | DryRunAnswer | ScaleDownAnswer:
        action = input_data["action"]
        if action == "scale_down":  # the framework's default: the least loaded, newest first
            return {"instance_id": contract.default_pick(input_data["payload"]["instances"])}
        payload: PlacementPayload = input_data["payload"]
        index = payload["cluster_metrics"].get("affinity_index") or affinity.empty_index()
        needs = payload["block"]["resources"]
        nodes = payload["cluster_metrics"]["nodes"]
        healthy = capacity.healthy_set(nodes, payload["healthy_nodes"])
        seed = tie_seed(payload["block"])
        if action == "dry_run":
            return self._dry_run(payload["block"], nodes, healthy, needs, index, seed)
        avoid = set()
        if action == "reassignment":
            current = payload["block"].get("instances", {}).get(payload["instance_id"], {})
            if current.get("node"):
                avoid.add(current["node"])
        pick = self._pick(nodes, healthy, needs, avoid, seed) or (self._pick(nodes, healthy, needs, set(), seed) if avoid else None)
        if pick is None:
            entries = payload["block"].get("affinity") or []
            sample = payload["cluster_metrics"].get("sample")
            if entries and sample and sample.get("unsatisfiable"):  # a large cluster: the reason covers every node
                raise RuntimeError(sample["unsatisfiable"])
            if entries and not sample and not any(n.get("affinity", {}).get("pass", True) for n in nodes.values()):
                raise RuntimeError(affinity.unsatisfiable(nodes, entries, index))
            seen = f" (visited {sample['visited']} of {sample['total_nodes']} nodes)" if sample else ""
            raise RuntimeError(f"no healthy node can host an instance needing {_fmt(needs)}{seen}")
        return {"node_id": pick[0], "gpus": pick[1]}

    def _dry_run(
        self, block: PolicyBlock, nodes: dict[str, NodeView], healthy: set[str], needs: Needs, index: affinity.Index,
        seed: str,
    ) -> DryRunAnswer:
        entries = block.get("affinity") or []
        # the first pick looks at the input's nodes as they are (an inventory view keeps its
        # nodes in rank order); a simulated placement then works on its own dict: with affinity
        # entries, copies of them all (re-annotated in place after each placement), else each node
        # copied when a placement first changes it (the input is not ours)
        def healthy_part() -> dict[str, NodeView]:
            return {nid: n for nid, n in nodes.items() if nid in healthy}

        work = capacity.copy_nodes(healthy_part()) if entries else nodes
        copied: set[str] = set(work) if entries else set()
        want = max(int(block["maxInstances"]), 1)
        first: Placement = {}
        placed = 0
        for i in range(want):
            pick = self._pick(work, healthy, needs, set(), seed)
            if pick is None:
                break
            if not first:
                first = {"node_id": pick[0], "gpus": pick[1]}
            placed += 1
            if i == want - 1:
                break  # nothing reads a simulated placement after the last one
            if work is nodes:
                work = healthy_part()
            if pick[0] not in copied:
                work[pick[0]] = capacity.copy_node(work[pick[0]])
                copied.add(pick[0])
            capacity.take(work[pick[0]], pick[1], needs, self.share)
            if entries:  # later replicas see earlier ones (a block spreading away from itself)
                rack = work[pick[0]]["labels"].get("rack", "")
                index = affinity.add_to_index(index, block["blockId"], f"{block['blockId']}-dry{i}", pick[0], rack)
                affinity.annotate(work, entries, index)
        # placeable: how many instances fit here (an optional extension of the seed's shape): the
        # gateway fails a block at once when no cluster can hold its minInstances
        return {"selection_score_data": {"score": placed / want, "node_info": first, "placeable": placed}}

    def _pick(
        self, nodes: dict[str, NodeView], healthy: set[str], needs: Needs, avoid: set[str], seed: str
    ) -> tuple[str, list[str]] | None:
        count = int(needs.get("gpus", 0))
        best: tuple[Any, str, list[GpuView]] | None = None
        share = self.share
        fits_key, rank_key = ("fits", *capacity.shape(needs, share)), ("rank", self.mode)

        def fits(n: NodeView) -> list[GpuView] | None:
            return capacity.node_fits(n, needs, share)

        if "affinity" not in next(iter(nodes.values()), {}):
            # no affinity annotations (the block has no entries; a view is annotated with all the
            # others or not at all, so its first says): every node's score is 0 and it passes,
            # so the best is the lowest (rank, id) that fits; the same choice, in one pass
            skip = capacity.unhealthy(nodes, healthy) | avoid
            found = capacity.best_fit(nodes, skip, fits_key, fits, rank_key, self._rank, count)
            return None if found is None else (found[0], self._choose_gpus(found[1], count, {}, seed))
        for nid, node in nodes.items():
            if nid not in healthy or nid in avoid:
                continue
            aff = node.get("affinity") or {}
            if not aff.get("pass", True):
                continue
            usable = capacity.derived(node, fits_key, fits)  # = node_fits_cached
            if usable is None or len(usable) < count:
                continue
            require = set(aff.get("require_gpus", []))
            if require and not require <= {g["id"] for g in usable}:
                continue  # a Required GPU of this node is busy
            key = (-float(aff.get("score", 0.0)), capacity.derived(node, rank_key, self._rank), nid)
            if best is None or key < best[0]:
                best = (key, nid, usable)
        if best is None:
            return None
        aff = nodes[best[1]].get("affinity") or {}
        return best[1], self._choose_gpus(best[2], count, aff, seed)

    def _rank(self, node: NodeView) -> tuple[float, ...]:
        # lower is better; bin-pack prefers the fullest node that fits, spread the emptiest
        free = capacity.free_gpus(node)
        mem = sum(g["memory_free"] for g in node["gpus"])
        if self.mode == "spread":
            return (-free, -mem, -node["cpu_free"])
        return (free, mem, node["cpu_free"])

    def _choose_gpus(self, usable: list[GpuView], count: int, aff: NodeAffinity, seed: str) -> list[str]:
        """Required GPUs first, then preferred, then by the mode; avoided GPUs last. Equal GPUs are
        taken in node order starting where a hash of the request says, not always from the first:
        controller copies planning different blocks on the same node at once then mostly take
        different GPUs instead of all racing for the first one (fewer conflicts and re-plans)."""
        require, prefer = set(aff.get("require_gpus", [])), set(aff.get("prefer_gpus", []))
        avoid = set(aff.get("avoid_gpus", []))
        sign = -1 if self.mode == "spread" else 1
        off = string_hash(seed) % len(usable) if usable else 0
        turn = {g["id"]: (i - off) % len(usable) for i, g in enumerate(usable)}

        def key(g: GpuView) -> tuple[Any, ...]:
            gid = g["id"]
            return (gid not in require, gid not in prefer, gid in avoid, sign * g["memory_free"], turn[gid], gid)

        return [g["id"] for g in sorted(usable, key=key)[:count]]


class BinPackPolicy(_ResourceAllocator):
    """Fill the fullest node that fits first (fewer, busier nodes; big gaps stay free)."""

    mode = "binpack"


class SpreadPolicy(_ResourceAllocator):
    """Place on the emptiest node (replicas land apart; failure blast radius is smaller)."""

    mode = "spread"


def _fmt(needs: Needs) -> str:
    return f"{needs.get('gpus', 0)} GPU(s) x {needs.get('gpuMemory', 0)} MiB, {needs.get('cpu', 0)} CPU, {needs.get('memory', 0)} MiB"
