"""The fold's own records (``recovery.fold.Fold``): what it keeps of a reservation, a dry_run
gather and a virtual cluster while it folds, typed. Their image forms are the Redis hashes and JSON
the scripts write (``Fold.image``)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from ..schemas.records import Placement


class Reservation(TypedDict):
    """A reservation as ``RESERVE_GANG`` records it: node, block, CPU, MiB, GPU -> MiB taken,
    exclusive (1/0) and, for a sharing instance, its compute units per GPU."""

    node: str
    block: str
    cpu: float
    mem: int
    gpus: dict[str, int]
    exclusive: int
    share: NotRequired[int]


class GatherResult(TypedDict):
    """One cluster's dry_run answer as a gather keeps it (``state.gathers``)."""

    score: float
    node_info: Placement
    error: str
    placeable: int
    shortfall: int


class Gather(TypedDict):
    """A selection round's gather: the clusters asked, when it is due, their answers, who decided."""

    expected: list[str]
    deadline: float
    results: dict[str, GatherResult]
    #: the decider's token ("" not decided)
    decided: str


class VClusterDoc(TypedDict, total=False):
    """The fields of a virtual cluster's stored record (``schemas.vcluster.VClusterRecord`` as JSON)
    the divisible-cluster repair reads and writes."""

    id: str
    kind: str
    parent: str
    #: node id -> node type
    nodes: dict[str, str]
