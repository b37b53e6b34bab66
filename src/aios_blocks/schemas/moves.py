"""Make-before-break moves of one instance of a placed block (issue 38 item 2, docs/rebalance.md).

A move is asked for with ``block.move.requested`` (``blocks move``, or the rebalancer); the
controller then records each step of it on the block's subject: ``block.move.started`` (the new
instance is reserved and being started), ``block.move.switched`` (it is ready; the mapper routes to
it and the old one drains), ``block.move.completed`` (the old one is gone and its reservation
released) or ``block.move.failed`` (with the reason: the old instance keeps serving and the new
one, if any, is removed and released).

Standard library and msgspec only, like every module of ``schemas/``.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from .events import Decision


class MovePhase(enum.StrEnum):
    """Where a move is, as its claim in Redis records it (``state.moves``)."""

    #: the claim is taken (the budget and the rate counted it); the new instance is being placed
    CLAIMED = "claimed"
    #: the new instance is reserved and its create command sent; waiting for it to be ready
    STARTED = "started"
    #: the new instance is ready, the old one is marked removing and told to drain
    SWITCHED = "switched"
    #: the move is over, the old instance removed (the claim is dropped)
    COMPLETED = "completed"
    #: the move failed (the claim is dropped; the old instance serves)
    FAILED = "failed"


class MoveRequested(msgspec.Struct):
    """Move one instance of a placed block elsewhere, make-before-break. Published by ``blocks
    move`` (admin) and by the rebalancer; the controller takes it (``handlers.moves``).

    ``move_id`` names the move: a request delivered twice, or published twice with the same id, is
    one move (the stream deduplicates the message by it, and the controller's claim is keyed by
    it)."""

    block_id: str
    move_id: str
    instance_id: str
    #: a node id of the block's cluster to move to; "" = placement chooses any node but the
    #: instance's own
    to_node: str = ""
    #: why, in words (shown in every step's event and in ``blocks explain``)
    reason: str = "requested"
    #: who asked: ``cli`` (``blocks move``), ``rebalancer``, ...
    requested_by: str = "cli"
    #: the block's generation when the request was made (0: whichever is current)
    gen: int = 0
    #: when the request was made (Unix seconds; 0: not said)
    at: float = 0.0
    #: the GPUs of ``to_node`` the new instance takes (the rebalancer's pick: topology, fragmentation);
    #: [] = the resourceAllocator (and the topology pass) picks. Not free then: the move fails
    to_gpus: list[str] = []


class MoveStep(msgspec.Struct):
    """One step of a move (``block.move.started`` / ``switched`` / ``completed`` / ``failed``):
    what moves where, and why. ``reason``: the request's reason for the steps that went well, what
    went wrong for ``failed``."""

    block_id: str
    gen: int
    move_id: str
    #: the instance moved (the old one)
    instance_id: str
    #: the old instance's node
    from_node: str = ""
    #: the new instance and its node ("" until placed: a move that failed before)
    new_instance_id: str = ""
    to_node: str = ""
    gpus: list[str] = []
    reason: str = ""
    requested_by: str = ""
    cluster_id: str = ""
    #: the policy calls of the placement (``started``; a ``failed`` placement's too)
    decisions: list[Decision] = []
    #: extra facts of the step: ``{"ready": n, "minInstances": m}`` at the switch, ...
    detail: dict[str, Any] = {}
