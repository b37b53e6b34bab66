"""Runs worker processes and replaces any that die (the `blocks up` process model).

Each worker process shares a durable consumer with its copies, so a SIGKILLed worker's unacked
messages are redelivered to its replacement (or its siblings).

A process runs one worker kind, or a **group** of kinds (``groups``: ``blocks up``'s default is
``DEFAULT_GROUPS``, three processes instead of eight, docs/benchmarks.md "Idle footprint"). Each
kind in a group keeps its own connections as its own role: the group process gets every kind's
URLs (and event key) in its environment, suffixed by kind (``kind_var``: ``AIOS_NATS_URL_PARSER``,
``AIOS_REDIS_URL_AGENT_SIM``...), never on its command line; it holds several roles' credentials
(docs/security.md). A kind of a group that fails to start or stops on its own ends the group
process with a non-zero status, and the supervisor starts the whole group again. Copies of a kind
beyond the first (``layout``: ``blocks up --controllers 2``) run as processes of their own.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..schemas import roles
from . import lifetime

DEFAULT_LAYOUT = roles.DEFAULT_LAYOUT
#: ``blocks up``'s processes (``blocks up --process-per-kind``: one per kind). The controller, the
#: heaviest kind of a placement burst, runs in a process of its own (no group names it), so on
#: two cores it and the kinds in front of it (parse, select, gather) work in parallel: +15-25 %
#: blocks/s against the three of them in one process (docs/benchmarks.md "Stop 27"). The light
#: services that watch running blocks share the front process; the (simulated) fleet and the task
#: ingress share another.
#: (``schemas.roles``: front holds parser, gateway, metrics, autoscaler, checker, rebalancer; serve agent-sim, executor)
DEFAULT_GROUPS = roles.DEFAULT_GROUPS
#: the variables that differ between kinds (a role's credentials, its event-id key): a group process
#: gets each kind's under ``kind_var(name, kind)``, and none unsuffixed
PER_KIND_VARS = ("AIOS_NATS_URL", "AIOS_REDIS_URL", "AIOS_EVENT_KEY")


def _utc_now() -> str:
    """Now as the workers' log lines write it (structlog's ISO timestamp, UTC, ``Z``)."""
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def kind_var(name: str, kind: str) -> str:
    """``AIOS_NATS_URL``, ``agent-sim`` -> ``AIOS_NATS_URL_AGENT_SIM``."""
    return f"{name}_{kind.upper().replace('-', '_')}"


def units(layout: Mapping[str, int], groups: Mapping[str, tuple[str, ...]] | None) -> list[tuple[str, tuple[str, ...], int]]:
    """The processes of ``layout``: (name, kinds, copy index). With ``groups``, each group's kinds
    that the layout runs share one process (named after the group; a group left with one kind is
    that kind's own process); copies beyond the first, and kinds in no group, get their own."""
    out: list[tuple[str, tuple[str, ...], int]] = []
    grouped: set[str] = set()
    for name, kinds in (groups or {}).items():
        present = tuple(k for k in kinds if layout.get(k, 0) > 0 and k not in grouped)
        grouped.update(present)
        if len(present) > 1:
            out.append((name, present, 0))
        elif present:
            out.append((present[0], present, 0))
    for kind, count in layout.items():
        for idx in range(1 if kind in grouped else 0, count):
            out.append((kind, (kind,), idx))
    return out


@dataclass
class Supervisor:
    nats_url: str
    redis_url: str
    layout: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LAYOUT))
    log_dir: str | None = None
    #: per-kind environment overrides: each worker's role credentials (``EmbeddedServers.worker_env``)
    role_env: Callable[[str], dict[str, str]] | None = None
    #: group name -> kinds run in one process (None: a process per kind)
    groups: Mapping[str, tuple[str, ...]] | None = None
    #: (process name: a kind or a group, copy index) -> the process
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = field(default_factory=dict)
    #: (process name, copy index) -> the kinds that process runs
    kinds: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    restarts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def env(self, kinds: tuple[str, ...]) -> dict[str, str]:
        """The environment of a process running ``kinds``: one kind's URLs as ``AIOS_NATS_URL`` /
        ``AIOS_REDIS_URL`` (its role's, with ``role_env``); a group's per kind (``kind_var``)."""
        env = {**os.environ, "AIOS_NATS_URL": self.nats_url, "AIOS_REDIS_URL": self.redis_url}
        if len(kinds) == 1:
            if self.role_env:
                env.update(self.role_env(kinds[0]))
            return env
        base = {k: env.pop(k) for k in PER_KIND_VARS if k in env}
        for name in list(env):  # none of another group's, nor the caller's, per-kind variables
            if any(name.startswith(v + "_") for v in PER_KIND_VARS):
                del env[name]
        for kind in kinds:
            own = {**base, **(self.role_env(kind) if self.role_env else {})}
            for name, value in own.items():
                env[kind_var(name, kind) if name in PER_KIND_VARS else name] = value
        return env

    def _spawn(self, key: tuple[str, int]) -> subprocess.Popen[bytes]:
        name, idx = key
        kinds = self.kinds[key]
        env = self.env(kinds)
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}-{idx}.log"), "ab")
        # own session: a Ctrl-C in the terminal reaches only the supervisor, which stops workers
        # in order; PDEATHSIG: a SIGKILLed supervisor takes its workers with it (spawned from the
        # main thread or the watch thread, both live as long as the workers should)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "aios_blocks.runtime.main", "+".join(kinds)], env=env, stdout=out, stderr=out,
                start_new_session=True, preexec_fn=lifetime.die_with_parent(),
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy

    def start(self) -> Supervisor:
        for name, kinds, idx in units(self.layout, self.groups):
            self.kinds[(name, idx)] = kinds
            self.procs[(name, idx)] = self._spawn((name, idx))
        self._thread = threading.Thread(target=self._watch, daemon=True, name="supervisor")
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for key, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    self.restarts += 1
                    self._note_exit(key, proc.returncode)
                    self.procs[key] = self._spawn(key)

    def _note_exit(self, key: tuple[str, int], code: int) -> None:
        """Say that a worker process died and is started again: one line on this process's stderr
        (the terminal of `blocks up`) and a ``supervisor.restart`` JSON line in the process's log
        (before its replacement's first line). A restart was silent before: a SIGKILLed or
        crash-looping worker left no trace anywhere."""
        name, idx = key
        kinds = self.kinds[key]
        how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"code {code}"
        what = f"{name}-{idx}" + (f" ({'+'.join(kinds)})" if len(kinds) > 1 else "")
        print(f"worker process {what} exited with {how}; started again (restart {self.restarts})", file=sys.stderr, flush=True)
        if self.log_dir:
            line = {"event": "supervisor.restart", "process": f"{name}-{idx}", "kinds": list(kinds), "exit_code": code,
                    "exited": how, "restarts": self.restarts, "level": "warning", "timestamp": _utc_now()}
            with contextlib.suppress(OSError), open(os.path.join(self.log_dir, f"{name}-{idx}.log"), "a") as f:
                f.write(json.dumps(line) + "\n")

    def pids(self, kind: str) -> list[int]:
        """The live processes running ``kind`` (alone or in a group)."""
        return [p.pid for key, p in self.procs.items() if kind in self.kinds[key] and p.poll() is None]

    def log_file(self, kind: str, idx: int = 0) -> str | None:
        """The log of the process running copy ``idx`` of ``kind`` (None without ``log_dir``)."""
        if not self.log_dir:
            return None
        for (name, i), kinds in self.kinds.items():
            if kind in kinds and i == idx:  # a group runs copy 0 of its kinds
                return os.path.join(self.log_dir, f"{name}-{i}.log")
        raise KeyError(f"no process runs copy {idx} of {kind!r}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.time() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
