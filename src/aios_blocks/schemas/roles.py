"""Who is who, named once: the roles that publish (the catalog's "published by" column), the worker
kinds a process runs (``blocks worker KIND``, ``blocks up``'s layout and process groups), and the
NATS and Redis users each logs in as. Every other list of roles or kinds derives from this table:
the supervisor's layout and groups, the worker entry's kinds, the permissions (``runtime.auth``),
the CLI's help, the inventory readers.

Standard library only: ``runtime.locate`` (every CLI command's start-up) imports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.StrEnum):
    """Who publishes. ``admin`` is the CLI (unrestricted); each worker kind has its NATS user."""

    UPSTREAM = "upstream"
    ADMIN = "admin"
    PARSER = "parser"
    GATEWAY = "gateway"
    CONTROLLER = "controller"
    AGENT = "agent"
    #: block services that serve tasks (executor, mapper): answer ``block.task`` requests
    EXECUTOR = "executor"
    #: the autoscaler (``blocks worker autoscaler``): decisions and instance targets
    AUTOSCALER = "autoscaler"
    #: the health checker (``blocks worker checker``): instance verdicts and failed ticks
    CHECKER = "checker"
    #: a block's side-cars (``aios_blocks.sidecar``): consume its outputs, raise alerts
    SIDECAR = "sidecar"
    #: each role's consumer runner dead-letters its own consumers' messages
    RUNNER = "runner"
    #: a tenant's clients, in its own NATS account (``runtime.tenants``): no user of the system's account
    TENANT = "tenant"
    #: the rebalancer (``blocks worker rebalancer``): move requests (docs/rebalance.md)
    REBALANCER = "rebalancer"


@dataclass(frozen=True)
class WorkerKind:
    """One kind of worker process: its name is its NATS user (``runtime.auth``) and its key in a
    ``blocks up`` layout."""

    name: str
    #: the catalog role whose events it publishes (``None``: it publishes none, the metrics collector)
    role: Role | None
    #: ``blocks up``'s default process for it ("": a process of its own, the controller)
    group: str = ""
    #: it reads the node inventory (the gateway's filter, the controller's placements), so it takes
    #: the inventory hints; the others never read it and take none
    reads_inventory: bool = False
    #: one line for the CLI's help
    summary: str = ""


#: Every worker kind, in ``blocks up``'s order.
WORKER_KINDS: tuple[WorkerKind, ...] = (
    WorkerKind("parser", Role.PARSER, "front", summary="creates -> submitted, parsed or rejected"),
    WorkerKind("gateway", Role.GATEWAY, "front", reads_inventory=True, summary="selection, dry_run gather, allocation request"),
    WorkerKind("controller", Role.CONTROLLER, reads_inventory=True,
               summary="placements, lifecycle, virtual clusters, node health, reconciler"),
    WorkerKind("agent-sim", Role.AGENT, "serve", summary="the simulated node agents"),
    WorkerKind("executor", Role.EXECUTOR, "serve", summary="block tasks over NATS and HTTP, routed by the instance maps"),
    WorkerKind("mapper", None, "serve", summary="the instance maps, from lifecycle facts (its durable: mapper)"),
    WorkerKind("metrics", None, "front", summary="the metrics collector"),
    WorkerKind("autoscaler", Role.AUTOSCALER, "front", summary="instance targets from the autoscaler policies"),
    WorkerKind("checker", Role.CHECKER, "front", summary="the health checker's verdicts"),
    WorkerKind("rebalancer", Role.REBALANCER, "front", summary="moves that make room for pending blocks or defragment (docs/rebalance.md)"),
)
KINDS: tuple[str, ...] = tuple(k.name for k in WORKER_KINDS)
BY_NAME: dict[str, WorkerKind] = {k.name: k for k in WORKER_KINDS}
#: the kinds that take inventory hints (``Worker.open``)
INVENTORY_KINDS = frozenset(k.name for k in WORKER_KINDS if k.reads_inventory)
#: ``blocks up``'s processes: group -> its kinds (a kind in no group runs on its own)
DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {
    g: tuple(k.name for k in WORKER_KINDS if k.group == g) for g in dict.fromkeys(k.group for k in WORKER_KINDS if k.group)
}
#: ``blocks up``'s copies of each kind
DEFAULT_LAYOUT: dict[str, int] = {k: 1 for k in KINDS}

#: NATS users: the CLI's admin, one per worker kind, and the users for people and other systems
#: (a real node agent logs in as ``agent-<nid>``, added on demand)
NATS_USERS: tuple[str, ...] = ("admin", *KINDS, "upstream", "observer", "sidecar")
#: worker kind -> its NATS user (the same name)
KIND_USER: dict[str, str] = {k: k for k in KINDS}
#: catalog role -> the NATS users that publish as it: each role's own user (``agent``: the real
#: agents' permissions), none for the admin (unrestricted), tenants (accounts of their own) and the runner (each role dead-letters
#: its own consumers' messages)
ROLE_USERS: dict[Role, tuple[str, ...]] = {r: () if r in (Role.ADMIN, Role.RUNNER, Role.TENANT) else (r.value,) for r in Role}
#: NATS user -> Redis user (node agents, upstream publishers and side-cars get no Redis access)
REDIS_USER: dict[str, str] = {"admin": "admin", **{k: "aios" for k in KINDS}, "observer": "observer"}

#: observers (people, dashboards; docs/security.md "Observers: a user each"): the data dir's own
#: ``observer`` and one user per client (``blocks observer add NAME``: ``observer-NAME``). Each may
#: create, read, pull from and delete only the consumers named after it, ``<user>_1`` to
#: ``<user>_<OBSERVER_CONSUMERS>`` (NATS permissions have no prefix wildcards: each name is listed)
OBSERVER = "observer"
OBSERVER_CONSUMERS = 32


def is_observer(user: str | None) -> bool:
    """Whether the NATS user ``user`` is an observer (``observer`` or ``observer-<name>``)."""
    return user is not None and (user == OBSERVER or user.startswith(OBSERVER + "-"))


def observer_consumers(user: str) -> tuple[str, ...]:
    """The consumer names the observer ``user`` may use, on ``AIOS`` and ``AIOS_OBSERVE``."""
    return tuple(f"{user}_{n}" for n in range(1, OBSERVER_CONSUMERS + 1))
