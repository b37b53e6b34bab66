"""Docker runtime through the ``docker`` SDK (blocking calls run in threads).

Every container carries the labels ``aios.block``, ``aios.instance``, ``aios.node`` (plus gen,
spec version, workdir, ports, GPUs) and is named ``aios-<instance id>``, so a second start of the
same instance finds the first container instead of making another. Host networking: an
instance's ports are host ports chosen by the agent. Real GPUs travel as device requests naming
their UUIDs (``docker run --gpus device=<uuid>,…``); inside the container they are renumbered from
0, so the instance's env names them by UUID (see ``gpus.gpu_env``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from dataclasses import dataclass, field
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest

from .runtime import LABEL_INSTANCE, LABEL_NODE, LaunchSpec, RuntimeError_, RuntimeInstance
from .runtime_process import quoted_tail

WORKDIR_IN_CONTAINER = "/aios/work"


def container_name(instance_id: str) -> str:
    return f"aios-{instance_id}"


@dataclass
class DockerRuntime:
    base_url: str | None = None
    name: str = "docker"
    #: reserved (real) GPUs are attached as device requests by UUID: the container sees only them
    gpu_devices: bool = True
    _client: Any = field(default=None, repr=False)

    def client(self) -> Any:
        if self._client is None:
            try:
                self._client = docker.DockerClient(base_url=self.base_url) if self.base_url else docker.from_env()
                self._client.ping()
            except DockerException as exc:
                self._client = None
                raise RuntimeError_(f"no Docker engine: {exc}") from None
        return self._client

    async def start(self, spec: LaunchSpec) -> RuntimeInstance:
        return await asyncio.to_thread(self._start, spec)

    def _start(self, spec: LaunchSpec) -> RuntimeInstance:
        c = self.client()
        name = container_name(spec.instance_id)
        with contextlib.suppress(NotFound):
            existing = c.containers.get(name)
            if existing.labels.get(LABEL_INSTANCE) == spec.instance_id and existing.status == "running":
                return _instance(existing)
            existing.remove(force=True)  # a dead leftover of this very instance: start afresh
        kwargs: dict[str, Any] = {
            "name": name,
            "labels": spec.labels(),
            "environment": {**spec.env, "AIOS_WORKDIR": WORKDIR_IN_CONTAINER if spec.workdir else ""},
            "network_mode": "host",
            "detach": True,
            "stop_signal": "SIGTERM",
        }
        if spec.command:
            kwargs["command"] = spec.command
        if spec.workdir:
            kwargs["volumes"] = {str(spec.workdir): {"bind": WORKDIR_IN_CONTAINER, "mode": "rw"}}
        if spec.gpus and spec.gpu_devices:
            kwargs["device_requests"] = [DeviceRequest(device_ids=list(spec.gpus), capabilities=[["gpu"]])]
        try:
            container = c.containers.run(spec.image, **kwargs)
        except ImageNotFound:
            raise RuntimeError_(f"image {spec.image!r} not found on this node (images are not pulled by tests)") from None
        except APIError as exc:
            with contextlib.suppress(DockerException):
                c.containers.get(name).remove(force=True)
            raise RuntimeError_(f"docker could not start {spec.image!r}: {exc.explanation or exc}") from None
        container.reload()
        return _instance(container)

    async def stop(self, handle: str, grace_s: float) -> None:
        await asyncio.to_thread(self._stop, handle, grace_s)

    def _stop(self, handle: str, grace_s: float) -> None:
        try:
            container = self.client().containers.get(handle)
        except NotFound:
            return
        with contextlib.suppress(NotFound, APIError):
            container.stop(timeout=max(0, round(grace_s)))
        try:
            container.remove(force=True)
        except NotFound:
            pass
        except APIError as exc:  # 409: someone else's removal of it is under way: it goes either way
            if exc.status_code != 409 or "already in progress" not in str(exc):
                raise

    async def status(self, handle: str) -> RuntimeInstance | None:
        return await asyncio.to_thread(self._status, handle)

    def _status(self, handle: str) -> RuntimeInstance | None:
        try:
            container = self.client().containers.get(handle)
            inst = _instance(container)
            if not inst.running and not inst.detail:  # why it exited: its last lines, as the process runtime says
                with contextlib.suppress(DockerException):
                    inst.detail = quoted_tail(container.logs(tail=5).decode("utf-8", "replace"))
            return inst
        except NotFound:
            return None

    async def list(self, node_id: str) -> list[RuntimeInstance]:
        return await asyncio.to_thread(self._list, {"label": [f"{LABEL_NODE}={node_id}"]})

    async def find(self, node_id: str, instance_id: str) -> RuntimeInstance | None:
        found = await asyncio.to_thread(
            self._list, {"label": [f"{LABEL_NODE}={node_id}", f"{LABEL_INSTANCE}={instance_id}"]}
        )
        return found[0] if found else None

    def _list(self, filters: dict[str, Any]) -> builtins.list[RuntimeInstance]:
        return [_instance(c) for c in self.client().containers.list(all=True, filters=filters)]

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


def _instance(container: Any) -> RuntimeInstance:
    state = container.attrs.get("State", {})
    running = container.status == "running"
    code = None if running else state.get("ExitCode")
    return RuntimeInstance(container.id, dict(container.labels), running, code, state.get("Error", ""))
