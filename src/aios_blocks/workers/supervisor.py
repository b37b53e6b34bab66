"""Runs worker processes and replaces any that die (the `blocks up` process model).

Each worker is its own OS process sharing a durable consumer with its copies, so a SIGKILLed
worker's unacked messages are redelivered to its replacement (or its siblings).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import lifetime

DEFAULT_LAYOUT = {"parser": 1, "gateway": 1, "controller": 1, "agent-sim": 1, "executor": 1, "metrics": 1, "autoscaler": 1, "checker": 1}


@dataclass
class Supervisor:
    nats_url: str
    redis_url: str
    layout: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LAYOUT))
    log_dir: str | None = None
    #: per-kind environment overrides: each worker's role credentials (``EmbeddedServers.worker_env``)
    role_env: Callable[[str], dict[str, str]] | None = None
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _spawn(self, kind: str, idx: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "AIOS_NATS_URL": self.nats_url, "AIOS_REDIS_URL": self.redis_url}
        if self.role_env:
            env.update(self.role_env(kind))
        out: Any = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{kind}-{idx}.log"), "ab")
        # own session: a Ctrl-C in the terminal reaches only the supervisor, which stops workers
        # in order; PDEATHSIG: a SIGKILLed supervisor takes its workers with it (spawned from the
        # main thread or the watch thread, both live as long as the workers should)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "aios_blocks.workers.main", kind], env=env, stdout=out, stderr=out,
                start_new_session=True, preexec_fn=lifetime.die_with_parent(),
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy

    def start(self) -> Supervisor:
        for kind, count in self.layout.items():
            for idx in range(count):
                self.procs[(kind, idx)] = self._spawn(kind, idx)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="supervisor")
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for key, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    self.restarts += 1
                    self.procs[key] = self._spawn(*key)

    def pids(self, kind: str) -> list[int]:
        return [p.pid for (k, _), p in self.procs.items() if k == kind and p.poll() is None]

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
