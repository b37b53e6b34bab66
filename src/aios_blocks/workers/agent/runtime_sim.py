"""Simulated runtime: no process; an instance "starts" after a delay and may fail at a given rate.

For the demo, scale tests and benchmarks. With ``state_dir`` the simulated engine keeps its
instances on disk (one JSON file each, like a container engine's own metadata), so simulated
instances outlive an agent restart just as containers do; without it they live in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from .runtime import LABEL_INSTANCE, LABEL_NODE, LaunchSpec, RuntimeError_, RuntimeInstance


@dataclass
class SimRuntime:
    start_delay_s: float = 0.05
    fail_rate: float = 0.0
    state_dir: Path | None = None
    name: str = "sim"
    gpu_devices: bool = False
    _items: dict[str, RuntimeInstance] = field(default_factory=dict)

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
        inst = RuntimeInstance(handle, spec.labels(), True)
        self._items[handle] = inst
        self._save(inst)
        return inst

    def crash(self, handle: str, exit_code: int = 137) -> None:
        """Make a running simulated instance exit (tests, chaos)."""
        inst = self._items[handle]
        inst.running, inst.exit_code = False, exit_code
        self._save(inst)

    async def stop(self, handle: str, grace_s: float) -> None:
        self._items.pop(handle, None)
        if self.state_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                (self.state_dir / f"{handle}.json").unlink()

    async def status(self, handle: str) -> RuntimeInstance | None:
        return self._items.get(handle)

    async def list(self, node_id: str) -> list[RuntimeInstance]:
        return [i for i in self._items.values() if i.labels.get(LABEL_NODE) == node_id]

    async def find(self, node_id: str, instance_id: str) -> RuntimeInstance | None:
        inst = self._items.get(f"sim-{instance_id}")
        if inst and inst.labels.get(LABEL_NODE) == node_id and inst.labels.get(LABEL_INSTANCE) == instance_id:
            return inst
        return None

    async def close(self) -> None:
        return None
