"""A node agent's side-cars (docs/sidecars.md): ``aios.node.{nid}.sidecar.start`` / ``.stop``.

* **start**: each of the side-car's ``replicas`` runs through the agent's runtime like an instance
  (process: ``command``; Docker: ``image`` + ``command``; sim: a record), labelled
  ``aios.kind=sidecar`` (reconcile leaves it alone), with no GPU, port or reservation. Its
  environment says which block, generation and side-car it serves, where NATS is
  (``AIOS_NATS_URL``: the side-car role's URL, ``sidecar_nats_url``) and its spec
  (``AIOS_SIDECAR``, JSON); ``parameters`` are also ``parameters.json`` in its working directory.
  A start of a side-car that already runs (a redelivered command, or one found running after an
  agent restart) adopts it.
* **watch**: a side-car that exits is started again after ``sidecar_restart_s`` (doubling up to
  30 s while it keeps dying; back to the first delay once it ran a minute).
* **stop**: every copy is stopped (SIGTERM, then SIGKILL after ``stopGraceS``), then the durable
  consumer is deleted (after the copies, so none creates it again) and the working directory removed.
* agent shutdown: watchers are cancelled, side-cars keep running (the next agent adopts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
from prometheus_client import Counter

from ..bus import subjects
from ..schemas.events import SidecarCommand
from ..schemas.spec import Sidecar
from .runtime import LaunchSpec, Runtime, RuntimeInstance

log = structlog.get_logger("aios.agent.sidecars")

RESTARTS = Counter("aios_agent_sidecar_restarts_total", "Side-cars started again after they exited", ["node"])
MAX_RESTART_DELAY_S = 30.0
LABEL_NAME = "aios.sidecar.name"
#: the start command (JSON): what an agent that restarted needs to watch the side-car again
LABEL_COMMAND = "aios.sidecar.command"
HEALTHY_RUN_S = 60.0


def copy_id(bid: str, name: str, k: int) -> str:
    """The runtime id of copy ``k`` of a side-car (never an instance id: those are ``{bid}-...``)."""
    return f"sc-{bid}-{name}-{k}"


@dataclass
class _Copy:
    cmd: SidecarCommand
    k: int
    handle: str = ""
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    started_at: float = 0.0


@dataclass
class SidecarManager:
    bus: Any
    runtime: Runtime
    node_id: str
    data_dir: Path
    nats_url: str = ""
    nats_ca: str = ""
    restart_s: float = 1.0
    workdirs: bool = True
    #: ``runtime.sidecar_users.SidecarUsers``: a NATS user per block (``None``: ``nats_url`` for all)
    users: Any = None
    copies: dict[str, _Copy] = field(default_factory=dict)
    #: block -> its side-cars' URL (their block's user), while this node runs some of them
    _urls: dict[str, str] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: (block, side-car) -> the newest generation stopped here: a start of it that comes late
    #: (redelivered after its stop) is ignored (bounded: the oldest entries go)
    _stopped: dict[tuple[str, str], int] = field(default_factory=dict)

    # -- commands ------------------------------------------------------------------------------
    async def start(self, cmd: SidecarCommand) -> None:
        spec = Sidecar.model_validate(cmd.sidecar)  # validated at parse: a bad one is a poison message
        async with self._lock:
            if self._stopped.get((cmd.block_id, cmd.name), -1) >= cmd.gen:
                log.info("sidecar.start_ignored", block=cmd.block_id, sidecar=cmd.name, why="already stopped")
                return
            await self._grant(cmd)
            for k in range(spec.replicas):
                cid = copy_id(cmd.block_id, cmd.name, k)
                copy = self.copies.get(cid)
                if copy is not None and copy.cmd.gen >= cmd.gen:
                    continue  # already ours (or a newer generation's)
                if copy is not None:  # an older generation's copy under the same id: replaced
                    await self._stop_copy(cid, copy, 0)
                found = await self.runtime.find(self.node_id, cid)
                copy = _Copy(cmd, k)
                if found is not None and found.running and found.gen == cmd.gen:
                    copy.handle = found.handle
                    log.info("sidecar.adopted", node=self.node_id, sidecar=cid)
                else:
                    if found is not None:
                        await self.runtime.stop(found.handle, 0)
                    copy.handle = (await self._launch(cmd, spec, cid)).handle
                copy.started_at = time.monotonic()
                copy.task = asyncio.create_task(self._watch(cid, copy, spec), name=f"sidecar:{cid}")
                self.copies[cid] = copy
                log.info("sidecar.started", node=self.node_id, block=cmd.block_id, sidecar=cmd.name, copy=k)

    async def stop(self, cmd: SidecarCommand) -> None:
        grace = float((cmd.sidecar or {}).get("stopGraceS", 10.0))
        async with self._lock:
            key = (cmd.block_id, cmd.name)
            self._stopped[key] = max(cmd.gen, self._stopped.pop(key, -1))
            while len(self._stopped) > 10_000:
                self._stopped.pop(next(iter(self._stopped)))
            for cid, copy in list(self.copies.items()):
                if self._is(copy.cmd.block_id, copy.cmd.name, cmd) and copy.cmd.gen <= cmd.gen:
                    await self._stop_copy(cid, copy, grace)
            for inst in await self.runtime.list(self.node_id):  # not watched (a restart), or left over
                if (inst.is_sidecar and self._is(inst.block_id, inst.labels.get(LABEL_NAME, ""), cmd)
                        and inst.gen <= cmd.gen):
                    await self.runtime.stop(inst.handle, grace)
                    if self.workdirs:
                        with contextlib.suppress(OSError):
                            shutil.rmtree(self.workdir(inst.instance_id))
            if not any(c.cmd.block_id == cmd.block_id for c in self.copies.values()):
                await self._release(cmd.block_id)
        durable = subjects.sidecar_durable(cmd.block_id, cmd.name)
        try:
            deleted = await self.bus.delete_consumer(subjects.STREAM_OUTPUTS, durable)
        except Exception as exc:  # no right, or NATS away: the command comes back
            raise RuntimeError(f"could not delete the side-car's consumer {durable}: {exc}") from exc
        log.info("sidecar.stopped", node=self.node_id, block=cmd.block_id, sidecar=cmd.name, consumer_deleted=deleted,
                 reason=cmd.reason)

    async def _grant(self, cmd: SidecarCommand) -> None:
        """The block's side-car user, with this side-car's rights (a config reload when new). If it
        cannot be had, the side-car gets ``nats_url`` (the shared ``sidecar`` user), said in the log."""
        if self.users is None:
            return
        try:
            self._urls[cmd.block_id] = await asyncio.to_thread(self.users.grant, cmd.block_id, cmd.name, self.node_id)
        except Exception as exc:
            log.warning("sidecar.user_failed", node=self.node_id, block=cmd.block_id, sidecar=cmd.name, error=repr(exc),
                        note="it logs in as the shared sidecar user")

    async def _release(self, bid: str) -> None:
        """This node runs none of the block's side-cars any more: off the block's user (it goes with
        the last node; also after an agent restart that found them stopped: idempotent)."""
        self._urls.pop(bid, None)
        if self.users is None:
            return
        try:
            await asyncio.to_thread(self.users.release, bid, self.node_id)
        except Exception as exc:
            log.warning("sidecar.user_release_failed", node=self.node_id, block=bid, error=repr(exc))

    @staticmethod
    def _is(bid: str, name: str, cmd: SidecarCommand) -> bool:
        return bid == cmd.block_id and name == cmd.name

    async def _stop_copy(self, cid: str, copy: _Copy, grace: float) -> None:
        copy.stopping = True
        if copy.task is not None:
            copy.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await copy.task
        if copy.handle:
            await self.runtime.stop(copy.handle, grace)
        self.copies.pop(cid, None)
        if self.workdirs:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.workdir(cid))

    # -- running -------------------------------------------------------------------------------
    def workdir(self, cid: str) -> Path:
        return (self.data_dir / "sidecars" / cid).resolve()

    def env(self, cmd: SidecarCommand, spec: Sidecar, k: int) -> dict[str, str]:
        env = dict(spec.env)
        env.update({
            "AIOS_BLOCK_ID": cmd.block_id,
            "AIOS_GEN": str(cmd.gen),
            "AIOS_CLUSTER_ID": cmd.cluster_id,
            "AIOS_NODE_ID": self.node_id,
            "AIOS_SIDECAR_NAME": spec.name,
            "AIOS_SIDECAR_COPY": str(k),
            "AIOS_SIDECAR": json.dumps(spec.model_dump(exclude={"env"}), sort_keys=True),
            "AIOS_SIDECAR_PARAMETERS": json.dumps(spec.parameters, sort_keys=True),
        })
        if url := self._urls.get(cmd.block_id) or self.nats_url:
            env["AIOS_NATS_URL"] = url
        if self.nats_ca:
            env["AIOS_NATS_CA"] = self.nats_ca
        return env

    async def _launch(self, cmd: SidecarCommand, spec: Sidecar, cid: str) -> RuntimeInstance:
        workdir = None
        if self.workdirs:
            workdir = self.workdir(cid)
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "parameters.json").write_text(json.dumps(spec.parameters, sort_keys=True))
        launch = LaunchSpec(
            instance_id=cid, block_id=cmd.block_id, node_id=self.node_id, gen=cmd.gen, image=spec.image,
            command=list(spec.command), env=self.env(cmd, spec, int(cid.rsplit("-", 1)[1])), workdir=workdir,
            stop_grace_s=spec.stopGraceS, kind="sidecar",
            extra_labels={LABEL_NAME: spec.name, LABEL_COMMAND: json.dumps(msgspec.to_builtins(cmd), sort_keys=True)},
        )
        return await self.runtime.start(launch)

    async def _watch(self, cid: str, copy: _Copy, spec: Sidecar) -> None:
        """Start the copy again whenever it is found not running (never while stopping)."""
        delay = self.restart_s
        while not copy.stopping:
            await asyncio.sleep(0.5)
            try:
                st = await self.runtime.status(copy.handle)
            except Exception as exc:
                log.warning("sidecar.status_failed", sidecar=cid, error=repr(exc))
                continue
            if st is not None and st.running:
                if time.monotonic() - copy.started_at > HEALTHY_RUN_S:
                    delay = self.restart_s
                continue
            if copy.stopping:
                return
            # ``output``: its last lines, where the runtime has them (why it exited: a module not found ...)
            log.warning("sidecar.exited", node=self.node_id, sidecar=cid, exit_code=None if st is None else st.exit_code,
                        output=None if st is None else st.detail, restart_in_s=delay)
            await asyncio.sleep(delay)
            if copy.stopping:
                return
            try:
                with contextlib.suppress(Exception):
                    await self.runtime.stop(copy.handle, 0)  # whatever is left of it
                copy.handle = (await self._launch(copy.cmd, spec, cid)).handle
                copy.started_at = time.monotonic()
                RESTARTS.labels(self.node_id).inc()
            except Exception as exc:
                log.warning("sidecar.restart_failed", sidecar=cid, error=repr(exc))
            delay = min(delay * 2, MAX_RESTART_DELAY_S)

    async def adopt_running(self) -> int:
        """After an agent restart: watch the side-cars of this node that still run."""
        n = 0
        for inst in await self.runtime.list(self.node_id):
            if not inst.is_sidecar or not inst.running or inst.instance_id in self.copies:
                continue
            raw = inst.labels.get(LABEL_COMMAND, "")
            if not raw:
                continue
            try:
                cmd = SidecarCommand(**json.loads(raw))
                spec = Sidecar.model_validate(cmd.sidecar)
            except Exception:
                continue
            if cmd.block_id not in self._urls:
                await self._grant(cmd)  # its restarts log in as its block's user again
            copy = _Copy(cmd, int(inst.instance_id.rsplit("-", 1)[1]), inst.handle, started_at=time.monotonic())
            copy.task = asyncio.create_task(self._watch(inst.instance_id, copy, spec), name=f"sidecar:{inst.instance_id}")
            self.copies[inst.instance_id] = copy
            n += 1
        return n

    def shutdown(self) -> None:
        """Agent shutdown: stop watching; the side-cars keep running for the next agent."""
        for copy in self.copies.values():
            if copy.task is not None:
                copy.task.cancel()
        self.copies.clear()
