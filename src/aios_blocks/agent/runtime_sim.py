"""Simulated runtime: no process; an instance "starts" after a delay and may fail at a given rate.

For the demo, scale tests and benchmarks. With ``state_dir`` the simulated engine keeps its
instances on disk (one JSON file each, like a container engine's own metadata), so simulated
instances outlive an agent restart just as containers do; without it they live in memory.

With a ``server`` (``sim_serve.SimServer``) every running simulated instance is also a real HTTP
server on 127.0.0.1 (task path, ``/health``, ``/metrics``; service time and failure rate from the
block's settings), on the launch port the agent gave it (``http`` or the first) or on a port of
its own; its endpoint is reported on the :class:`RuntimeInstance`. An instance read back from
``state_dir`` is served again, on the same port, when the agent next lists or finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from ..schemas.protocol import INSTANCE_TOKEN_ENV, endpoint_port, endpoint_url
from .runtime import LABEL_INSTANCE, LABEL_NODE, LABEL_PORTS, LaunchSpec, RuntimeError_, RuntimeInstance
from .sim_serve import SimBehaviour, SimServer

#: where a served simulated instance keeps its behaviour (with its labels, so a restored one serves alike)
LABEL_SIM = "aios.sim"


#: a behaviour's label by its values (most instances of a fleet behave alike: one JSON text)
_LABELS: dict[tuple[object, ...], str] = {}


def _behaviour_label(b: SimBehaviour) -> str:
    """``json.dumps(b.__dict__, sort_keys=True)``, made once per distinct behaviour (kept for 1,024)."""
    values = tuple(b.__dict__.values())
    key = (values, tuple(map(type, values)))  # 0 and 0.0 are equal keys, not the same text
    text = _LABELS.get(key)
    if text is None:
        text = json.dumps(b.__dict__, sort_keys=True)
        if len(_LABELS) < 1024:
            _LABELS[key] = text
    return text


@dataclass
class SimRuntime:
    start_delay_s: float = 0.05
    fail_rate: float = 0.0
    state_dir: Path | None = None
    name: str = "sim"
    gpu_devices: bool = False
    server: SimServer | None = None
    _items: dict[str, RuntimeInstance] = field(default_factory=dict)
    #: removals from the server in flight (held: the loop keeps only a weak reference to a task)
    _removing: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            for f in self.state_dir.glob("*.json"):
                with contextlib.suppress(ValueError, OSError):
                    d = json.loads(f.read_text())
                    self._items[d["handle"]] = RuntimeInstance(d["handle"], d["labels"], d["running"], d.get("exit_code"))

    def _save(self, inst: RuntimeInstance) -> None:
        if self.state_dir is not None:
            path = self.state_dir / f"{inst.handle}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"handle": inst.handle, "labels": inst.labels, "running": inst.running,
                                       "exit_code": inst.exit_code}))
            tmp.replace(path)

    async def start(self, spec: LaunchSpec) -> RuntimeInstance:
        handle = f"sim-{spec.instance_id}"
        if handle in self._items and self._items[handle].running:
            return self._items[handle]
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        if self.fail_rate > 0 and random.random() < self.fail_rate:
            raise RuntimeError_("start failed (simulated)")
        labels = spec.labels()
        inst = RuntimeInstance(handle, labels, True)
        if self.server is not None and spec.kind == "instance":  # a simulated side-car serves nothing
            behaviour = SimBehaviour.from_env(spec.env)
            served = await self.server.add(spec.instance_id, behaviour, endpoint_port(spec.ports) or 0,
                                           spec.env.get(INSTANCE_TOKEN_ENV, ""))
            if not spec.ports:  # a port of its own: recorded so a restored instance gets it back
                labels[LABEL_PORTS] = json.dumps({"http": served.port})
            labels[LABEL_SIM] = _behaviour_label(behaviour)
            inst.endpoint = endpoint_url(self.server.host, served.port)
        self._items[handle] = inst
        self._save(inst)
        return inst

    async def _serve_again(self, inst: RuntimeInstance) -> RuntimeInstance:
        """A running instance read back from ``state_dir`` is served again on its recorded port."""
        if self.server is None or not inst.running or inst.endpoint:
            return inst
        try:
            ports = {str(k): int(v) for k, v in json.loads(inst.labels.get(LABEL_PORTS) or "{}").items()}
            behaviour = SimBehaviour(**json.loads(inst.labels.get(LABEL_SIM) or "{}"))
        except (ValueError, TypeError):
            return inst
        port = endpoint_port(ports)
        if port:
            with contextlib.suppress(OSError):
                served = await self.server.add(inst.instance_id, behaviour, port)
                inst.endpoint = endpoint_url(self.server.host, served.port)
        return inst

    def crash(self, handle: str, exit_code: int = 137) -> None:
        """Make a running simulated instance exit (tests, chaos): it stops serving too."""
        inst = self._items[handle]
        inst.running, inst.exit_code = False, exit_code
        if self.server is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing is served either
                task = asyncio.get_running_loop().create_task(self.server.remove(inst.instance_id, grace_s=0))
                self._removing.add(task)
                task.add_done_callback(self._removing.discard)
        self._save(inst)

    async def stop(self, handle: str, grace_s: float) -> None:
        inst = self._items.pop(handle, None)
        if inst is not None and self.server is not None:
            await self.server.remove(inst.instance_id, grace_s)
        if self.state_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                (self.state_dir / f"{handle}.json").unlink()

    async def status(self, handle: str) -> RuntimeInstance | None:
        return self._items.get(handle)

    async def list(self, node_id: str) -> list[RuntimeInstance]:
        return [await self._serve_again(i) for i in self._items.values() if i.labels.get(LABEL_NODE) == node_id]

    async def find(self, node_id: str, instance_id: str) -> RuntimeInstance | None:
        inst = self._items.get(f"sim-{instance_id}")
        if inst and inst.labels.get(LABEL_NODE) == node_id and inst.labels.get(LABEL_INSTANCE) == instance_id:
            return await self._serve_again(inst)
        return None

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
