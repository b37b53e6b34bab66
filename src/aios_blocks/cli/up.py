"""The process a `blocks up` stays as: servers, supervised workers, nothing else.

`blocks up` is parsed by the CLI (``cli.app``: typer and rich; pydantic through typer), which
then replaces itself (``exec``, the same pid, so ``kill`` and signals reach the
same process) with ``python -m aios_blocks.cli.up``. This module imports only what starting and
supervising need: the modules of every other command would stay resident for the system's whole
life, ~30 MiB of the idle footprint (issue 14: <= 300 MiB over all processes;
docs/benchmarks.md "Idle footprint"). ``running`` is also the servers-and-workers scope of
`blocks demo`, which runs in the full CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit

from rich.console import Console
from rich.markup import escape

from ..runtime import lifetime
from ..runtime.auth import mask
from ..runtime.embedded import EmbeddedServers, port_again, redis_version, write_whole
from ..runtime.server_keeper import ServerKeeper, ServersGiveUp
from ..runtime.supervisor import DEFAULT_GROUPS, DEFAULT_LAYOUT, Supervisor

T = TypeVar("T")

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def exec_up(data_dir: Path, layout: dict[str, int], process_per_kind: bool, console_port: int | None = 0) -> NoReturn:
    """Become the lean `blocks up` process (same pid): ``python -m aios_blocks.cli.up``. The data
    dir's lock is taken first and kept across the exec (``--lock-fd``): from then on a command
    run meanwhile knows a `blocks up` is starting there and waits for it (``locate.starting``)
    instead of saying there are no servers, and a second `blocks up` is refused at once."""
    argv = [sys.executable, "-m", "aios_blocks.cli.up", "--data-dir", str(data_dir), "--layout", json.dumps(layout)]
    if process_per_kind:
        argv.append("--process-per-kind")
    argv += ["--no-console"] if console_port is None else ["--console-port", str(console_port)]
    if data_dir.exists() and not data_dir.is_dir():
        err.print(f"[red]--data-dir {escape(str(data_dir))} is not a directory[/]")
        raise SystemExit(2)
    if not (os.environ.get("AIOS_NATS_URL") and os.environ.get("AIOS_REDIS_URL")):  # (else no servers of ours)
        try:
            lock = lifetime.DataDirLock(data_dir).acquire()
        except lifetime.DataDirBusy as exc:
            err.print(f"[red]{escape(str(exc))}[/]")
            raise SystemExit(1) from None
        assert lock.fd is not None
        os.set_inheritable(lock.fd, True)
        argv += ["--lock-fd", str(lock.fd)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


@contextlib.contextmanager
def running(data_dir: Path, layout: dict[str, int] | None = None, process_per_kind: bool = False,
            lock_fd: int | None = None) -> Iterator[tuple[EmbeddedServers | None, Supervisor]]:
    """Servers (unless AIOS_*_URL are set) and workers for the block inside; SIGTERM, SIGHUP and
    SIGINT (even when started in the background, where the shell ignores SIGINT) stop them like
    Ctrl-C, in order: workers, then servers. A data dir in use by another process: exit 1.
    ``lock_fd``: the data dir's lock, already held (``exec_up``)."""
    servers: EmbeddedServers | None = None
    sup: Supervisor | None = None
    with lifetime.stop_on_signals():
        try:
            nats_url, redis_url = os.environ.get("AIOS_NATS_URL"), os.environ.get("AIOS_REDIS_URL")
            if not (nats_url and redis_url):
                try:
                    servers = EmbeddedServers(data_dir=data_dir, topology_in_child=True)
                    if lock_fd is not None:
                        servers._lock = lifetime.DataDirLock.adopt(data_dir, lock_fd)
                    servers.start()
                except lifetime.DataDirBusy as exc:
                    err.print(f"[red]{escape(str(exc))}[/]")
                    raise SystemExit(1) from None
                except (RuntimeError, OSError) as exc:  # no server binary, one that exits at start...: what, not a traceback
                    err.print(f"[red]cannot start the servers[/]: {escape(str(exc))}")
                    raise SystemExit(2) from None
                nats_url, redis_url = nats_url or servers.nats_url, redis_url or servers.redis_url
                os.environ.setdefault("AIOS_NATS_URL", nats_url)
                os.environ.setdefault("AIOS_REDIS_URL", redis_url)
            layout = layout or dict(DEFAULT_LAYOUT)
            if layout.get("executor"):
                _http_ingress(servers)
            if layout.get("metrics"):
                _metrics_discovery(servers)
            sup = Supervisor(
                nats_url, redis_url, layout,
                log_dir=str(Path(data_dir).resolve() / "logs"), role_env=servers.worker_env if servers else None,
                groups=None if process_per_kind else DEFAULT_GROUPS,
            ).start()
            yield servers, sup
        except KeyboardInterrupt as exc:
            console.print(f"stopping ({exc.args[0] if exc.args else 'SIGINT'})")
        finally:
            if sup:
                sup.stop()
            if servers:
                servers.stop()


def serve(data_dir: Path, layout: dict[str, int], process_per_kind: bool, lock_fd: int | None = None,
          console_port: int | None = 0) -> None:
    """`blocks up`'s body: start, say where everything is, supervise until stopped.
    ``console_port``: the web console's (0: the one it had last time, else a free one; None: none)."""
    with running(data_dir, layout, process_per_kind, lock_fd) as (servers, sup), _console(servers, data_dir, console_port) as web:
        where = f"  data {servers.data_dir} (Redis {servers.redis_server} v{redis_version(servers.redis_server)})" if servers else ""
        procs = ", ".join(f"{n}-{i} ({'+'.join(k)})" if len(k) > 1 else f"{n}-{i}" for (n, i), k in sup.kinds.items())
        console.print(f"[green]up[/]: NATS {mask(sup.nats_url)}  Redis {mask(sup.redis_url)}  workers {procs}{where}")
        console.print(f"logs: {sup.log_dir}/<process>-<n>.log" + (f", {servers.data_dir}/nats.log, {servers.data_dir}/redis.log" if servers else ""))
        if os.environ.get("AIOS_EXECUTOR_HTTP_PORT") and layout.get("executor"):
            creds = " (HTTP Basic: curl -u upstream:PASSWORD, from auth/secrets.json)" if servers and servers.auth else ""
            console.print(f"tasks: POST http://127.0.0.1:{os.environ['AIOS_EXECUTOR_HTTP_PORT']}/blocks/<bid>/tasks{creds}, or `blocks task <bid>`")
        if os.environ.get("AIOS_METRICS_SD_PORT") and layout.get("metrics"):
            console.print("metrics: `blocks top`, `blocks prometheus-config` (docs/metrics.md)")
        if web:
            console.print(web)
        if servers is None:  # your own servers (AIOS_NATS_URL / AIOS_REDIS_URL): say so if none answers
            for what, url, port in (("NATS", sup.nats_url, 4222), ("Redis", sup.redis_url, 6379)):
                if not answers(url, port):
                    err.print(f"[yellow]warning[/]: nothing answers at {escape(mask(url))} ({what}): the workers keep "
                              f"trying until it does (their logs: {sup.log_dir})")
        keep_servers(ServerKeeper(servers) if servers else None)  # a dead embedded server is started again


def keep_servers(keeper: ServerKeeper | None) -> NoReturn:
    """Look after the embedded servers for ever, from this (the main) thread, which started them
    (they die with it): one that died is started again; one that died too often ends it, exit 2."""
    while True:
        time.sleep(0.2)
        check_servers(keeper)


def check_servers(keeper: ServerKeeper | None) -> None:
    """One look of ``keep_servers`` (``blocks demo`` takes one every 0.2 s while it runs too)."""
    if keeper:
        try:
            keeper.check()
        except ServersGiveUp as exc:
            err.print(f"[red]error[/]: {escape(str(exc))}")
            raise SystemExit(2) from None


async def kept(keeper: ServerKeeper | None, work: Awaitable[T]) -> T:
    """``work`` while the embedded servers are looked after (``check_servers``, every 0.2 s, on the
    event loop: the main thread, as `blocks up`'s): `blocks demo` hung or spewed errors when one
    died under it. One that died too often cancels ``work`` and exits 2."""
    import asyncio

    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.2)
            check_servers(keeper)
    finally:
        task.cancel()
    return task.result()


def answers(url: str, default_port: int, timeout: float = 2.0) -> bool:
    """Whether any server of ``url`` (``nats://a:4222,nats://b:4222``, ``redis+cluster://a:7001,b:7002``,
    credentials and a path allowed) accepts a TCP connection within ``timeout`` seconds."""
    for part in url.split(","):
        try:
            where = urlsplit("//" + part.split("://", 1)[-1])  # (a list's later entries may lack the scheme)
            with socket.create_connection((where.hostname or "127.0.0.1", where.port or default_port), timeout=timeout):
                return True
        except (OSError, ValueError):
            continue
    return False


@contextlib.contextmanager
def _console(servers: EmbeddedServers | None, data_dir: Path, port: int | None) -> Iterator[str]:
    """The web console (docs/console.md) as a child process, in ``endpoints.json`` as ``"console"``;
    yields the line that says where (and its admin token), "" with none."""
    if port is None:
        yield ""
        return
    from ..console import launch

    if port:
        os.environ["AIOS_CONSOLE_PORT"] = str(port)
    _publish_port(servers, "AIOS_CONSOLE_PORT", "AIOS_CONSOLE_HOST", "console")
    host = os.environ.get("AIOS_CONSOLE_HOST", "127.0.0.1")
    # (kept: a console that exits is started again on the same port, docs/console.md)
    kept = launch.Kept(servers.data_dir if servers else data_dir, int(os.environ["AIOS_CONSOLE_PORT"]), host,
                       embedded=servers is not None, preexec=lifetime.die_with_parent())
    url, token = kept.url, kept.token
    try:
        yield f"console: {url} (read only); admin: {url}#token={token} (token in {data_dir}/console/token)"
    finally:
        kept.stop()


def _http_ingress(servers: EmbeddedServers | None) -> None:
    """The executors' HTTP port (``AIOS_EXECUTOR_HTTP_PORT``, else a free one), in the workers'
    environment and in ``endpoints.json`` as ``"http"``."""
    _publish_port(servers, "AIOS_EXECUTOR_HTTP_PORT", "AIOS_EXECUTOR_HTTP_HOST", "http")


def _metrics_discovery(servers: EmbeddedServers | None) -> None:
    """The metrics collector's discovery port (``AIOS_METRICS_SD_PORT``, else a free one), in the
    workers' environment and in ``endpoints.json`` as ``"metrics"`` (``blocks prometheus-config``)."""
    _publish_port(servers, "AIOS_METRICS_SD_PORT", "AIOS_METRICS_HOST", "metrics")


def _publish_port(servers: EmbeddedServers | None, port_var: str, host_var: str, key: str) -> None:
    """``port_var`` from the environment, else the port this data dir had last time when free
    (``port_again``: a restart keeps the address clients use), else a free one, put there (the
    workers inherit it), and ``http://{host_var or 127.0.0.1}:{port}`` in ``endpoints.json`` under ``key``."""
    port = os.environ.get(port_var)
    if not port or port == "0":
        if servers is not None:
            port = str(port_again(servers.data_dir, key))
        else:
            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = str(sk.getsockname()[1])
        os.environ[port_var] = port
    if servers is not None:
        ep = servers.data_dir / "endpoints.json"
        doc = json.loads(ep.read_text())
        doc[key] = f"http://{os.environ.get(host_var, '127.0.0.1')}:{port}"
        write_whole(ep, json.dumps(doc))


def main(argv: list[str] | None = None) -> None:
    """``python -m aios_blocks.cli.up --data-dir DIR --layout JSON [--process-per-kind]``: what
    `blocks up` execs once its options are checked (use `blocks up`: it resolves the data dir and
    checks the counts)."""
    p = argparse.ArgumentParser(prog="blocks up", description=main.__doc__)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--layout", type=json.loads, required=True, help="worker kind -> copies, as JSON")
    p.add_argument("--process-per-kind", action="store_true")
    p.add_argument("--console-port", type=int, default=0, help="the web console's port (0: as last time, else free)")
    p.add_argument("--no-console", action="store_true", help="no web console")
    p.add_argument("--lock-fd", type=int, help="the data dir's lock, held open by the process that exec-ed this one")
    args = p.parse_args(argv)
    layout = args.layout
    if not isinstance(layout, dict) or not all(k in DEFAULT_LAYOUT and type(v) is int and v >= 0 for k, v in layout.items()):
        p.error(f"--layout: a JSON object of worker kind ({', '.join(DEFAULT_LAYOUT)}) -> copies >= 0")
    serve(args.data_dir, layout, args.process_per_kind, args.lock_fd, None if args.no_console else args.console_port)


if __name__ == "__main__":
    main()
