"""Which nodes a placement looks at when a cluster is large (Nomad's limit iterator).

A cluster with at most ``threshold`` nodes is seen whole (``sampleNodes``; kube-scheduler's
floor of 100 nodes). Above that, nodes are visited in a seeded pseudo-random order (the same
block sees the same order on the same snapshot) and the visit stops after
``max(2, ceil(log2 n), min(want, threshold))`` *feasible* nodes: healthy, room for one instance, passing the
block's Required affinity. A cluster with no feasible node is therefore scanned to the end, so
sampling never hides the only node that fits; it only bounds the work when many fit.

The threshold comes from the resourceAllocator rule's ``settings.sampleNodes`` (``0`` = never
sample), else ``AIOS_SAMPLE_NODES``, else 100.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ..schemas.records import AffinityTerm, BlockIR, NodeView, SampleInfo
from ..settings import load as load_settings
from . import affinity, capacity


def default_threshold() -> int:
    """``AIOS_SAMPLE_NODES`` (the process's settings, read when a block asks, never at import)."""
    return load_settings().sample_nodes


#: infeasible nodes kept in a sample that found no feasible one, so a policy can show why
KEEP_INFEASIBLE = 16


def threshold_of(ir: BlockIR) -> int:
    """``settings.sampleNodes`` of the block's resourceAllocator rule, else the default."""
    rule = (ir.get("policies") or {}).get("resourceAllocator") or {}
    value = (rule.get("settings") or {}).get("sampleNodes")
    if value is None:
        return default_threshold()
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return default_threshold()


def limit(n: int) -> int:
    """Nomad's limit iterator: how many feasible nodes are enough out of ``n``."""
    return max(2, math.ceil(math.log2(n))) if n > 1 else 1


def walk(n: int, seed: str) -> tuple[int, int]:
    """``(start, stride)`` of ``visit_order(n, seed)`` (n >= 1)."""
    rng = random.Random(seed)  # str seeds hash with sha512: stable across processes
    start = rng.randrange(n)
    stride = 1
    if n > 2:
        stride = rng.randrange(1, n)
        while math.gcd(stride, n) != 1:
            stride = stride % (n - 1) + 1
    return start, stride


def visit_order(n: int, seed: str) -> Iterator[int]:
    """Each of ``range(n)`` exactly once, in an order fixed by ``seed``: ``start + i * stride``
    (mod n) with a seeded start and a seeded stride coprime to n. O(1) to set up, unlike a shuffle."""
    if n <= 0:
        return
    start, stride = walk(n, seed)
    for i in range(n):
        yield (start + i * stride) % n


def feasible(node: NodeView, needs: capacity.Needs, share: bool) -> bool:
    """Healthy, room for one instance, passes Required affinity (with its Required GPUs free)."""
    aff = node.get("affinity") or {}
    if not aff.get("pass", True):
        return False
    usable = capacity.node_fits_cached(node, needs, share)
    if usable is None:
        return False
    require = aff.get("require_gpus")
    return not require or set(require) <= {g["id"] for g in usable}


@dataclass
class Sample:
    """The node views a placement considers (annotated copies when the block has affinity)."""

    nodes: dict[str, NodeView]
    total: int
    visited: int
    feasible: int
    affinity_pass: int
    sampled: bool
    seed: str = ""
    limit: int = 0
    #: set when no visited node passes Required affinity: each entry and what it eliminated
    unsatisfiable: str = ""

    def info(self) -> SampleInfo:
        """What a policy sees under ``cluster_metrics["sample"]`` when the cluster was sampled."""
        out: SampleInfo = {
            "total_nodes": self.total, "visited": self.visited, "feasible": self.feasible,
            "limit": self.limit, "seed": self.seed,
        }
        if self.unsatisfiable:
            out["unsatisfiable"] = self.unsatisfiable
        return out


def sample(
    nodes: dict[str, NodeView],
    needs: capacity.Needs,
    share: bool,
    seed: str,
    threshold: int | None = None,
    want: int = 1,
    entries: list[AffinityTerm] | None = None,
    index: affinity.Index | None = None,
) -> Sample:
    """The nodes to consider for one placement: all of them (annotated) when the cluster is small,
    else a seeded sample with enough feasible nodes (or every node, when fewer exist)."""
    entries = entries or []
    index = index or affinity.empty_index()
    n = len(nodes)
    if threshold is None:
        threshold = default_threshold()
    if threshold <= 0 or n <= threshold:
        return _sample_all(nodes, needs, share, entries, index)
    k = max(limit(n), min(max(want, 1), n, threshold))  # want is capped at the threshold
    if not entries and isinstance(nodes, capacity.Nodes):
        return _sample_indexed(nodes, needs, share, seed, n, k)
    return _sample_walk(nodes, needs, share, seed, k, entries, index)


def _sample_all(
    nodes: dict[str, NodeView], needs: capacity.Needs, share: bool, entries: list[AffinityTerm], index: affinity.Index
) -> Sample:
    """A small cluster: every node, annotated with its affinity when the block has any."""
    n = len(nodes)
    work = nodes
    if entries:
        work = {nid: {**v} for nid, v in nodes.items()}
        affinity.annotate(work, entries, index)
    if entries:
        fits = sum(1 for v in work.values() if feasible(v, needs, share))
    else:  # feasible = fits one instance: the count kept incrementally per nodes dict and shape
        fits = capacity.fitting(work, needs, share)
    passing = sum(1 for v in work.values() if v["affinity"]["pass"]) if entries else n
    reason = affinity.unsatisfiable(work, entries, index) if entries and not passing else ""
    return Sample(work, n, n, fits, passing, False, unsatisfiable=reason)


def _sample_walk(
    nodes: dict[str, NodeView], needs: capacity.Needs, share: bool, seed: str, k: int,
    entries: list[AffinityTerm], index: affinity.Index,
) -> Sample:
    """The seeded walk over the nodes' views until ``k`` feasible ones (else a few infeasible)."""
    n = len(nodes)
    ids = capacity.node_ids(nodes)
    picked: dict[str, NodeView] = {}
    others: dict[str, NodeView] = {}
    visited = passing = 0
    for i in visit_order(n, seed):
        nid = ids[i]
        view = nodes[nid]
        if entries:
            view = {**view}
            affinity.annotate({nid: view}, entries, index)
        visited += 1
        if view.get("affinity", {}).get("pass", True):
            passing += 1
        if feasible(view, needs, share):
            picked[nid] = view
            if len(picked) >= k:
                break
        elif len(others) < KEEP_INFEASIBLE:
            others[nid] = view
    reason = ""
    if entries and not passing:  # every node failed Required affinity: say which entry, over all
        reason = affinity.unsatisfiable(nodes, entries, index)
    chosen = picked if picked else others
    return Sample(chosen, n, visited, len(picked), passing, True, seed, k, reason)


def _sample_indexed(nodes: capacity.Nodes, needs: capacity.Needs, share: bool, seed: str, n: int, k: int) -> Sample:
    """``sample``'s walk for a block without affinity on an inventory view, read from the
    cluster's capacity index (``capacity.fit_index``: which nodes fit this shape, kept as views
    change) instead of the views: the same nodes in the same order with the same counts, touching
    O(k) nodes where fitting ones are dense and O(fitting) where they are rare, never all of them.
    Feasible here is "fits one instance" (no affinity to pass)."""
    index = capacity.fit_index(nodes, needs, share)
    ids = nodes.ids()
    start, stride = walk(n, seed)
    count = index.count
    picked: dict[str, NodeView] = {}
    if count == 0:  # the walk would visit every node and keep the first few it saw
        others = {}
        for j in range(min(KEEP_INFEASIBLE, n)):
            nid = ids[(start + j * stride) % n]
            others[nid] = nodes[nid]
        return Sample(others, n, n, 0, n, True, seed, k)
    if count < k or 2 * count * count < k * n:
        # rare: order the fitting nodes by when the walk reaches them (j = (i - start) / stride)
        pos = nodes.positions()
        inv = pow(stride, -1, n)
        when = sorted(((pos[nid] - start) * inv % n, nid) for nid in index.ids)[:k]
        for _, nid in when:
            picked[nid] = nodes[nid]
        visited = n if count < k else when[-1][0] + 1
        return Sample(picked, n, visited, len(picked), visited, True, seed, k)
    fits = index.fits
    visited = 0
    for j in range(n):  # dense: about k * n / count steps
        nid = ids[(start + j * stride) % n]
        visited += 1
        if fits(nid):
            picked[nid] = nodes[nid]
            if len(picked) >= k:
                break
    return Sample(picked, n, visited, len(picked), visited, True, seed, k)
