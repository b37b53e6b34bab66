"""A node as the fold keeps it (``recovery.fold``): its spec, capacity and what is held on it, and
the Redis hash ``Store.put_node`` and the capacity scripts leave for it. Apart from the fold so the
console's projection (``console.projection``) can read nodes without the fold's rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..schemas.records import JSONObject

_json = msgspec.json
_enc = msgspec.json.Encoder()


def dumps(v: Any) -> str:
    return _enc.encode(v).decode()


@dataclass
class NodeState:
    cluster: str
    spec: str
    cpu: float
    memory: int
    healthy: bool
    gpu_total: dict[str, int]
    #: who serves the node's commands ("" = the simulated fleet)
    agent: str = ""
    cpu_used: float | None = None
    mem_used: int | None = None
    #: gpu -> [mem, n, x] (None until first touched, as HINCRBY creates fields)
    gpu_use: dict[str, list[int]] = field(default_factory=dict)
    #: GPU -> thousandths of its compute held by sharing instances' ``gpuShare`` (``g:<gpu>:share``)
    gpu_share: dict[str, int] = field(default_factory=dict)
    #: its place (virtual cluster id; "" = the primary) and the cluster index of its last move
    vc: str = ""
    vc_index: int = 0
    #: ``blocks node drain``
    drain: bool = False
    #: (spec, its rack label): a cache of ``rack()``
    _rack: tuple[str, str] | None = field(default=None, repr=False, compare=False)

    def gpus_spec(self) -> list[JSONObject]:
        """The GPUs of its spec (id, model, ...)."""
        return list(_json.decode(self.spec).get("gpus") or [])

    def rack(self) -> str:
        """The ``rack`` label of its spec (decoded once per spec, not once per placement)."""
        if self._rack is None or self._rack[0] is not self.spec:
            self._rack = (self.spec, _json.decode(self.spec).get("labels", {}).get("rack", ""))
        return self._rack[1]

    def hash(self) -> dict[str, str]:
        """The node's Redis hash, as ``Store.put_node`` and the capacity scripts leave it."""
        h: dict[str, str] = {"spec": self.spec, "cpu": _num(self.cpu), "memory": str(self.memory), "healthy": "1" if self.healthy else "0"}
        if self.agent:
            h["agent"] = self.agent
        for g, total in self.gpu_total.items():
            h[f"g:{g}:total"] = str(total)
        if self.cpu_used is not None:
            h["cpu_used"] = _num(self.cpu_used)
        if self.mem_used is not None:
            h["mem_used"] = str(self.mem_used)
        for g, (mem, cnt, x) in self.gpu_use.items():
            h[f"g:{g}:mem"], h[f"g:{g}:n"], h[f"g:{g}:x"] = str(mem), str(cnt), str(x)
        for g, units in self.gpu_share.items():
            if units:
                h[f"g:{g}:share"] = str(units)
        if self.vc:
            h["vc"] = self.vc
        if self.drain:
            h["drain"] = "1"
        return h


def _num(v: float | int) -> str:
    """A number as Redis prints it back: integers without a decimal point."""
    f = float(v)
    return str(int(f)) if f.is_integer() else repr(f)
