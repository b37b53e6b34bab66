"""A placement plan (``blocks submit --dry-run``, as Nomad's ``job plan``): the placement pipeline
run against one inventory snapshot, with nothing committed and nothing published.

It chains the workers' own pure steps in the order the events would run them: the gateway's
``select`` (filter rule + clusterAllocator selection), the controller's ``dry_run`` on every
candidate, the gateway's ``choose`` (post_dry_run) and the controller's gang ``plan`` (action
``allocation``, minInstances instance ids) on the chosen cluster. The caller supplies the snapshot
and the invokers (``cli.client.Client.plan``: policies run with throwaway contexts, no decision
records), and reads the state index around the snapshot.

Pure: no I/O here besides the invokers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict, cast

from ..policies import affinity
from ..schemas.errors import PlacementFailed, SpecError
from ..schemas.records import AdaptTable, BlockIR, ClusterRecord, NodeView, Placement
from . import controller, gateway

Invoke = gateway.Invoke


class PlanCall(TypedDict):
    """One policy call a plan made (``cli.client.Client.plan``; ``blocks submit --dry-run``)."""

    #: clusterAllocator or resourceAllocator
    kind: str
    action: str
    uri: str
    version: int | None
    #: the policy's failure ("" when it answered)
    error: str


class DryRunDoc(TypedDict):
    """A dry_run outcome as a plan's JSON holds it (``controller.DryRunOutcome``'s fields, in order)."""

    score: float
    node_info: Placement
    error: str
    rejected_nodes: dict[str, str]
    node_scores: dict[str, float]
    placeable: int
    shortfall: int
    adapt: AdaptTable


class SpecErrorDoc(TypedDict):
    path: str
    message: str


class PlanDoc(TypedDict):
    """``blocks submit --dry-run``'s document (``Plan.as_dict``; ``--json`` prints it)."""

    block_id: str
    index: int
    places: bool
    errors: list[SpecErrorDoc]
    candidates: list[str]
    filtered: dict[str, str]
    dry_runs: dict[str, DryRunDoc]
    cluster_id: str
    #: one per instance of the gang: {"iid", "node", "gpus"} (``controller.plan``'s records)
    placements: list[dict[str, Any]]
    failure: str
    stage: str
    calls: list[PlanCall]
    notes: list[str]


@dataclass
class Plan:
    block_id: str
    #: the state index (``Store.state_index``) the snapshot was read at; -1 when not read
    index: int = -1
    #: spec problems (then nothing else was computed), as the parser would reject them
    errors: list[SpecError] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)
    #: cluster -> why the filter rule or the selection left it out (``Selection.filtered``)
    filtered: dict[str, str] = field(default_factory=dict)
    #: cluster -> its dry_run outcome (score, node_info, error, rejected_nodes, placeable, ...)
    dry_runs: dict[str, controller.DryRunOutcome] = field(default_factory=dict)
    cluster_id: str = ""
    #: one per instance of the gang: {"iid", "node", "gpus"}
    placements: list[dict[str, Any]] = field(default_factory=list)
    #: why it would not place ("" when it would); ``stage`` says which step said so
    failure: str = ""
    stage: str = ""
    #: the policy calls the plan made
    calls: list[PlanCall] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def places(self) -> bool:
        return not self.errors and not self.failure

    def as_dict(self) -> PlanDoc:
        return {
            "block_id": self.block_id,
            "index": self.index,
            "places": self.places,
            "errors": [{"path": e.path, "message": e.message} for e in self.errors],
            "candidates": self.candidates,
            "filtered": self.filtered,
            "dry_runs": {cid: cast(DryRunDoc, asdict(out)) for cid, out in self.dry_runs.items()},
            "cluster_id": self.cluster_id,
            "placements": self.placements,
            "failure": self.failure,
            "stage": self.stage,
            "calls": self.calls,
            "notes": self.notes,
        }


def result_of(out: controller.DryRunOutcome) -> dict[str, Any]:
    """A dry_run outcome as the gateway gathers it (what ``dry_run.result`` carries to ``choose``)."""
    return {"score": out.score, "node_info": out.node_info, "error": out.error, "placeable": out.placeable,
            "shortfall": out.shortfall}


async def make_plan(
    ir: BlockIR,
    clusters: dict[str, ClusterRecord],
    nodes: dict[str, dict[str, NodeView]],
    cluster_invoke: Invoke,
    resource_invoke: Invoke,
    index: affinity.Index | None = None,
) -> Plan:
    """Where the block would go on this snapshot, and why not when it would not."""
    plan = Plan(ir["blockId"])
    sel = await gateway.select(ir, clusters, nodes, cluster_invoke, index)
    plan.candidates, plan.filtered = sel.candidates, dict(sel.filtered)
    if sel.failure:
        plan.failure, plan.stage = sel.failure, "selection"
        return plan
    for cid in sel.candidates:
        cluster = clusters.get(cid, {"id": cid, "labels": {}})
        plan.dry_runs[cid] = await controller.dry_run(ir, cluster, nodes.get(cid, {}), resource_invoke, index)
    results = {cid: result_of(out) for cid, out in plan.dry_runs.items()}
    entries = {cid: gateway.scoped_entry(ir, clusters[cid], nodes.get(cid, {}), index) for cid in sel.candidates if cid in clusters}
    decision = await gateway.choose(sel.candidates, results, entries, cluster_invoke, int(ir.get("minInstances") or 1))
    if decision.failure:
        plan.failure, plan.stage = decision.failure, "post_dry_run"
        return plan
    cid = plan.cluster_id = decision.cluster_id
    iids = [controller.instance_id(ir["blockId"], i) for i in range(int(ir.get("minInstances") or 0))]
    try:
        made = await controller.plan(
            ir, clusters.get(cid, {"id": cid, "labels": {}}), nodes.get(cid, {}), "allocation", iids, resource_invoke, None, index
        )
    except PlacementFailed as exc:
        plan.failure, plan.stage = f"{cid}: {exc.reason}", "allocation"
        return plan
    plan.placements = [{"iid": p["iid"], "node": p["node"], "gpus": list(p["gpus"]),
                        **({"adaptive": p["adaptive"]} if p.get("adaptive") else {}),
                        **({"topology": p["topology"]} if p.get("topology") else {})} for p in made]
    return plan
