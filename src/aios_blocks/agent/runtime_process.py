"""Local-process runtime: an instance is a subprocess in its own session (it outlives the agent).

Its labels travel in its environment (``AIOS_LABELS``, JSON), so after an agent restart the agent
finds its processes by reading ``/proc/<pid>/environ`` — the process itself is the record, as
container labels are for Docker. The agent's own environment (which may hold credentials) is not
inherited: an instance gets ``PATH`` (the agent's own Python's directory first, :func:`base_env`),
``HOME``/``LANG`` and what its spec says.

Processes are host-wide, so a runtime with a ``scope`` (the agent's: a digest of its agent
directory, :func:`process_scope`) labels what it starts with it (``aios.scope``) and sees only
processes of its scope: two systems on one host whose agents have the same node names (two
``blocks up`` data dirs, two test runs) never see, adopt, report as dangling or stop each other's
instances. A process without the label (started before scopes existed) is seen by every scope of
its node, as before.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .runtime import LABEL_INSTANCE, LABEL_NODE, LABEL_SCOPE, LaunchSpec, RuntimeError_, RuntimeInstance

LABELS_ENV = "AIOS_LABELS"
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV")


def process_scope(agent_dir: Path | str) -> str:
    """The scope of the agents using this agent directory (its absolute path, digested)."""
    return hashlib.sha256(str(Path(agent_dir).resolve()).encode()).hexdigest()[:16]


def _handle(proc: psutil.Process) -> str:
    return f"{proc.pid}-{int(proc.create_time() * 1000)}"


def _split(handle: str) -> tuple[int, int]:
    pid, created = handle.split("-", 1)
    return int(pid), int(created)


@dataclass
class ProcessRuntime:
    name: str = "process"
    gpu_devices: bool = False
    #: "" : every process of a node, whatever started it (tools, tests); else this scope's only
    scope: str = ""
    _children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: handle -> the instance's output file (``instance.log`` in its working directory), whose last
    #: lines say why it exited (the directory is removed with the instance)
    _logs: dict[str, Path] = field(default_factory=dict)

    def _labels_of(self, spec: LaunchSpec) -> dict[str, str]:
        labels = spec.labels()
        if self.scope:
            labels[LABEL_SCOPE] = self.scope
        return labels

    def _ours(self, labels: dict[str, str]) -> bool:
        return not self.scope or labels.get(LABEL_SCOPE, self.scope) == self.scope

    async def start(self, spec: LaunchSpec) -> RuntimeInstance:
        if not spec.command:
            raise RuntimeError_("the process runtime needs a command (component launch.command)")
        labels = self._labels_of(spec)
        proc = await asyncio.to_thread(_spawn, spec, labels)
        handle = _handle(await asyncio.to_thread(labelled, proc))
        self._children[handle] = proc
        if spec.workdir:
            self._logs[handle] = spec.workdir / "instance.log"
        return RuntimeInstance(handle, labels, True)

    def _proc(self, handle: str) -> psutil.Process | None:
        pid, created = _split(handle)
        try:
            p = psutil.Process(pid)
            if int(p.create_time() * 1000) != created:
                return None  # the pid was reused by something else
            return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    async def status(self, handle: str) -> RuntimeInstance | None:
        child = self._children.get(handle)
        if child is not None:
            code = child.poll()
            labels = _labels(self._proc(handle)) if code is None else {}
            detail = "" if code is None else await asyncio.to_thread(last_output, self._logs.get(handle))
            return RuntimeInstance(handle, labels, code is None, code, detail)
        p = self._proc(handle)
        if p is None:
            return None
        try:
            running = p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return None
        return RuntimeInstance(handle, _labels(p), running, None if running else -1)

    async def stop(self, handle: str, grace_s: float) -> None:
        pid, _ = _split(handle)
        p = self._proc(handle)
        child = self._children.pop(handle, None)
        self._logs.pop(handle, None)
        if p is None and child is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        try:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                if child is not None and child.poll() is not None:
                    break
                if child is None and (p is None or not p.is_running() or p.status() == psutil.STATUS_ZOMBIE):
                    break
                await asyncio.sleep(0.05)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(child.wait, 5)
        finally:
            # whatever else is left in the instance's process group; also when this wait is cut
            # short (the agent stopping mid-grace cancels it): what was told to stop never runs on,
            # an orphan of init until the next agent comes
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    async def list(self, node_id: str) -> list[RuntimeInstance]:
        return await asyncio.to_thread(self._scan, node_id, None)

    async def find(self, node_id: str, instance_id: str) -> RuntimeInstance | None:
        for handle, child in self._children.items():
            if child.poll() is None:
                labels = _labels(self._proc(handle))
                if labels.get(LABEL_NODE) == node_id and labels.get(LABEL_INSTANCE) == instance_id:
                    return RuntimeInstance(handle, labels, True)
        found = await asyncio.to_thread(self._scan, node_id, instance_id)
        return found[0] if found else None

    def _scan(self, node_id: str, instance_id: str | None) -> builtins.list[RuntimeInstance]:
        out = []
        for p in psutil.process_iter():
            labels = _labels(p)
            if labels.get(LABEL_NODE) != node_id or not self._ours(labels):
                continue
            if instance_id is not None and labels.get(LABEL_INSTANCE) != instance_id:
                continue
            try:
                if os.getpgid(p.pid) != p.pid:
                    continue  # a child of the instance (it inherited the labels): the leader is the instance

                running = p.status() != psutil.STATUS_ZOMBIE
                handle = _handle(p)
            except (psutil.Error, ProcessLookupError):
                continue
            out.append(RuntimeInstance(handle, labels, running, None if running else -1))
        return out

    async def close(self) -> None:
        return None


def last_output(log: Path | None, lines: int = 2, limit: int = 300) -> str:
    """The last non-empty lines of an instance's output, quoted (its exit's reason: a Python
    traceback ends with the exception), or "" when it wrote none. An instance that exited before its
    probe was reported as only "exited with code 1", its output removed with its directory."""
    if log is None:
        return ""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return quoted_tail(text, lines, limit)


def quoted_tail(text: str, lines: int = 2, limit: int = 300) -> str:
    """``last output '<line> | <line>'``: the last non-empty lines of an output, or ""."""
    tail = " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])
    return f"last output {tail[-limit:]!r}" if tail else ""


def base_env() -> dict[str, str]:
    """What an instance inherits of the agent's environment (``BASE_ENV``), with the directory of
    the agent's own Python first on ``PATH`` when it is not there: a command's ``python`` (the
    shipped examples' ``python -m aios_blocks.examples.echo``) is then the interpreter the agent
    runs in, whose packages it has, as when its venv is active. An agent started as
    ``.venv/bin/blocks agent`` without activating the venv ran ``python`` from wherever ``PATH``
    pointed (``cannot exec 'python'``, or one without the package)."""
    env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
    own = str(Path(sys.executable).parent)
    path = env.get("PATH", os.defpath)
    if sys.executable and own not in path.split(os.pathsep):
        env["PATH"] = own + os.pathsep + path
    return env


def _spawn(spec: LaunchSpec, labels: dict[str, str]) -> subprocess.Popen[bytes]:
    env = base_env()
    env.update(spec.env)
    env[LABELS_ENV] = json.dumps(labels, sort_keys=True)
    cwd = str(spec.workdir) if spec.workdir else None
    log_path = (spec.workdir / "instance.log") if spec.workdir else None
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            spec.command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        raise RuntimeError_(f"cannot exec {spec.command[0]!r}: {exc.strerror or exc}") from None
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]


#: how long a started process may take to carry its labels (see ``labelled``)
EXEC_WAIT_S = 5.0


def labelled(proc: subprocess.Popen[bytes]) -> psutil.Process:
    """The started process, once its labels can be read (or it has ended). ``Popen`` forks with
    vfork, which lets the parent go on while the child is still inside ``execve``: for that moment
    its ``/proc`` environ reads empty, and a ``list`` or ``find`` right after ``start`` (an agent's
    inventory) would miss an instance it just started."""
    p = psutil.Process(proc.pid)
    deadline = time.monotonic() + EXEC_WAIT_S
    while not _labels(p) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return p


def _labels(p: psutil.Process | None) -> dict[str, str]:
    if p is None:
        return {}
    try:
        raw = p.environ().get(LABELS_ENV)
    except (psutil.Error, OSError):
        return {}
    if not raw:
        return {}
    try:
        d = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in d.items()} if isinstance(d, dict) else {}
