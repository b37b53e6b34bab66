"""What a runtime (Docker, local process, simulated) must do for the node agent.

A runtime starts an instance from a :class:`LaunchSpec`, stops it with a grace period, reports
its status and lists every instance carrying this node's labels. The labels are the only record
of what runs where: after an agent restart they are read back (``labels_to_resources``) to
re-adopt an instance with all its resources, so nothing is kept in a local state file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict

from ..schemas.records import JSONObject

LABEL_BLOCK = "aios.block"
LABEL_INSTANCE = "aios.instance"
LABEL_NODE = "aios.node"
LABEL_GEN = "aios.gen"
LABEL_VERSION = "aios.spec-version"
LABEL_WORKDIR = "aios.workdir"
LABEL_PORTS = "aios.ports"
LABEL_GPUS = "aios.gpus"
LABEL_RESOURCES = "aios.resources"
#: the spec's stopGraceS, so a re-adopted instance is stopped with its own grace, not the default
LABEL_STOP_GRACE = "aios.stop-grace"
#: the process runtime's scope: which agent directory (and so which system) started the instance
LABEL_SCOPE = "aios.scope"
#: ``sidecar`` on a block's side-car (absent on instances): reconcile leaves side-cars alone
LABEL_KIND = "aios.kind"
SPEC_VERSION = "1"


def json_text(v: Any) -> str:
    """``json.dumps(v, sort_keys=True)``, the same text; an empty object without the encoder (the
    common ``{}`` of a block's settings and of an instance with no port: a few microseconds each)."""
    if type(v) is dict and not v:
        return "{}"
    return json.dumps(v, sort_keys=True)


@dataclass
class LaunchSpec:
    instance_id: str
    block_id: str
    node_id: str
    gen: int
    image: str = ""
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold AIOS_INSTANCE_TOKEN: never in a log
    workdir: Path | None = None
    ports: dict[str, int] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)
    #: attach ``gpus`` as devices (real NVIDIA GPUs and a runtime that can); simulated GPUs only
    #: travel in env
    gpu_devices: bool = False
    resources: JSONObject = field(default_factory=dict)
    stop_grace_s: float = 10.0
    #: ``instance`` or ``sidecar`` (a side-car carries the label ``aios.kind=sidecar``)
    kind: str = "instance"
    #: more labels (a side-car's name and command, to adopt it after an agent restart)
    extra_labels: dict[str, str] = field(default_factory=dict)

    def labels(self) -> dict[str, str]:
        extra = {LABEL_KIND: self.kind, **self.extra_labels} if self.kind != "instance" else dict(self.extra_labels)
        return {
            **extra,
            LABEL_BLOCK: self.block_id,
            LABEL_INSTANCE: self.instance_id,
            LABEL_NODE: self.node_id,
            LABEL_GEN: str(self.gen),
            LABEL_VERSION: SPEC_VERSION,
            LABEL_WORKDIR: str(self.workdir or ""),
            LABEL_PORTS: json_text(self.ports),
            LABEL_GPUS: ",".join(self.gpus),
            LABEL_RESOURCES: json_text(self.resources),
            LABEL_STOP_GRACE: f"{self.stop_grace_s:g}",
        }


@dataclass
class RuntimeInstance:
    """What a runtime knows of one instance."""

    handle: str
    labels: dict[str, str]
    running: bool
    exit_code: int | None = None
    detail: str = ""
    #: where it serves HTTP when the runtime itself knows (the simulated runtime picks its own
    #: port); else the agent derives it from the launch ports (``schemas.protocol``)
    endpoint: str = ""

    @property
    def instance_id(self) -> str:
        return self.labels.get(LABEL_INSTANCE, "")

    @property
    def block_id(self) -> str:
        return self.labels.get(LABEL_BLOCK, "")

    @property
    def is_sidecar(self) -> bool:
        return self.labels.get(LABEL_KIND) == "sidecar"

    @property
    def gen(self) -> int:
        try:
            return int(self.labels.get(LABEL_GEN, "0"))
        except ValueError:
            return 0


class Adopted(TypedDict):
    """What an instance's labels record for its re-adoption (``labels_to_resources``)."""

    workdir: str
    #: port name -> port (as the agent wrote it)
    ports: dict[str, int]
    gpus: list[str]
    #: what it was given (``InstanceCommand.resources``, JSON)
    resources: JSONObject
    #: its spec's stopGraceS (10, the default, for an instance labelled before it was recorded)
    stop_grace_s: float


def labels_to_resources(labels: dict[str, str]) -> Adopted:
    """Resources recorded on an instance's labels (for re-adoption): workdir, ports, GPUs, stop grace."""

    def _json(key: str, default: Any) -> Any:
        try:
            return json.loads(labels.get(key, "")) if labels.get(key) else default
        except ValueError:
            return default

    gpus = [g for g in labels.get(LABEL_GPUS, "").split(",") if g]
    return {
        "workdir": labels.get(LABEL_WORKDIR) or "",
        "ports": _json(LABEL_PORTS, {}),
        "gpus": gpus,
        "resources": _json(LABEL_RESOURCES, {}),
        "stop_grace_s": _float(labels.get(LABEL_STOP_GRACE), LaunchSpec.stop_grace_s),
    }


def _float(text: str | None, default: float) -> float:
    try:
        return float(text) if text else default
    except ValueError:
        return default


class RuntimeError_(Exception):
    """A runtime could not do what was asked (image missing, exec failed...)."""


#: the runtimes an agent runs instances with (``agent.main.make_runtime``; ``blocks agent --runtime``)
RUNTIMES = ("docker", "process", "sim")


class Runtime(Protocol):
    name: str
    #: the runtime attaches real GPUs to an instance as devices (Docker); without it an instance
    #: sees the host's GPUs and is pointed at its own by env only (process runtime)
    gpu_devices: bool

    async def start(self, spec: LaunchSpec) -> RuntimeInstance: ...

    async def stop(self, handle: str, grace_s: float) -> None:
        """Stop and remove; absent is fine (idempotent)."""
        ...

    async def status(self, handle: str) -> RuntimeInstance | None:
        """None when the instance no longer exists."""
        ...

    async def list(self, node_id: str) -> list[RuntimeInstance]:
        """Every instance labelled for this node (running or not)."""
        ...

    async def find(self, node_id: str, instance_id: str) -> RuntimeInstance | None: ...

    async def close(self) -> None: ...
