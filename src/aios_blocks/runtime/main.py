"""Worker process entry: ``python -m aios_blocks.runtime.main KIND`` (or ``blocks worker KIND``),
or ``... main KIND+KIND...``: a group of kinds in one process (``blocks up``'s default, see
``supervisor.DEFAULT_GROUPS``), each with its own connections as its own role (its URLs and event
key from ``AIOS_NATS_URL_<KIND>``, ``AIOS_REDIS_URL_<KIND>``, ``AIOS_EVENT_KEY_<KIND>``, else the
unsuffixed ones), its log lines marked with its ``kind``, and one ``/metrics`` for the process.
A kind that fails to start or stops on its own stops the others and the process exits 1 (its
supervisor starts it again); SIGTERM/SIGINT stop every kind.

Lean by design (docs/benchmarks.md "Idle footprint"): this module imports only the standard library
at the top; a worker process loads its own kind's modules and nothing of the other kinds', and
(``lean_imports``) loads structlog without rich and nats-py without aiohttp, optional packages they
pick up when installed but that no worker uses from them (JSON logs; nats:// and tls:// URLs, no
websocket). A test keeps each kind's process free of the modules it does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..schemas.roles import KINDS  # stdlib only, like this module

if TYPE_CHECKING:
    from ..settings import Settings
    from ..workers.base import Worker

#: how long a group's kinds get to stop after SIGTERM (the supervisor kills at 10 s)
STOP_TIMEOUT_S = 8.0

#: package -> optional packages it imports when they are installed, which no worker uses through it:
#: structlog's rich (pretty console tracebacks; workers log JSON), ~5 MiB per process. (nats-py's
#: aiohttp, its websocket transport, ~11 MiB, is not loaded until used in any process that imports
#: aios_blocks: ``aios_blocks.OnFirstUse``.)
UNUSED_EXTRAS = {"structlog": ("rich",)}


@contextlib.contextmanager
def _absent(names: tuple[str, ...]) -> Iterator[None]:
    """While inside, ``import NAME`` raises ImportError for each of ``names`` not yet imported;
    afterwards they import normally again (a kind that needs aiohttp itself still gets it)."""
    blocked = [n for n in names if n not in sys.modules]
    for n in blocked:
        sys.modules[n] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for n in blocked:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


def lean_imports() -> None:
    """Import ``UNUSED_EXTRAS``' packages without their unused extras (a no-op for one already
    imported, e.g. in ``blocks worker``, where the CLI has loaded rich)."""
    for pkg, extras in UNUSED_EXTRAS.items():
        if pkg not in sys.modules:
            with _absent(extras):
                importlib.import_module(pkg)


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr at ``level`` (``Settings.log_level``: AIOS_LOG_LEVEL)."""
    import logging

    import structlog

    level = level.upper()

    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(message)s", stream=sys.stderr)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
    )


async def run_worker(kind: str, nats_url: str, redis_url: str, cluster: str | None = None, stop: asyncio.Event | None = None,
                     settings: Settings | None = None) -> None:
    """One kind in this process, with the process's ``settings`` (built once by the entry point)."""
    if kind not in KINDS:
        raise ValueError(f"unknown worker kind {kind!r}; one of {', '.join(KINDS)}")
    import structlog

    from ..workers.base import Worker, stop_on_signals

    structlog.contextvars.bind_contextvars(kind=kind)  # in every line of this worker's log
    w = await Worker.open(nats_url, redis_url, kind, settings)
    stop = stop or stop_on_signals()
    from ..workers import telemetry

    served = asyncio.get_running_loop().create_task(telemetry.serve(w, kind, cluster, stop))  # this worker's /metrics
    try:
        await _run_kind(w, kind, cluster, stop)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(served, 5)
        await w.close()


class KindStopped(RuntimeError):
    """A kind of a group process failed to start or stopped on its own."""


def group_urls(kinds: list[str], environ: Mapping[str, str]) -> dict[str, tuple[str, str, str | None]]:
    """kind -> (NATS URL, Redis URL, event key) of a group process: ``AIOS_*_<KIND>``, else the
    unsuffixed variable (KeyError naming the variable when neither is set)."""
    from .supervisor import kind_var

    def get(name: str, kind: str, required: bool = True) -> str | None:
        value = environ.get(kind_var(name, kind)) or environ.get(name)
        if value is None and required:
            raise KeyError(f"{kind_var(name, kind)} (or {name})")
        return value

    return {k: (str(get("AIOS_NATS_URL", k)), str(get("AIOS_REDIS_URL", k)), get("AIOS_EVENT_KEY", k, False)) for k in kinds}


async def run_group(kinds: list[str], urls: Mapping[str, tuple[str, str, str | None]], cluster: str | None = None,
                    stop: asyncio.Event | None = None, settings: Settings | None = None) -> None:
    """Run ``kinds`` in this process, each its own ``Worker`` (connections, role, event key, log
    ``kind``); one ``/metrics`` target for the process. Raises ``KindStopped`` when a kind fails to
    open or its run ends (with an error or not) before ``stop``."""
    _check_group(kinds)
    import structlog

    from ..settings import load as load_settings
    from ..workers.base import Worker, stop_on_signals

    log = structlog.get_logger("aios.worker")
    stop = stop or stop_on_signals()
    base = settings or load_settings()
    workers: dict[str, Worker] = {}

    async def open_kind(kind: str) -> Worker:
        # its own task: the connections' reader tasks it starts keep its ``kind`` in their lines
        structlog.contextvars.bind_contextvars(kind=kind)
        nats_url, redis_url, key = urls[kind]
        settings = base.model_copy(update={"event_key": key}) if key else base
        return await Worker.open(nats_url, redis_url, kind, settings)

    async def run_kind(kind: str) -> None:
        structlog.contextvars.bind_contextvars(kind=kind)
        await _run_kind(workers[kind], kind, cluster, stop)

    from ..workers import telemetry

    name = "+".join(kinds)
    structlog.contextvars.bind_contextvars(kind=name)  # the process's own lines; each kind's task binds its own
    served: asyncio.Task[None] | None = None
    runs: dict[asyncio.Task[None], str] = {}
    try:
        for kind in kinds:
            try:
                workers[kind] = await asyncio.create_task(open_kind(kind))
            except Exception as exc:
                log.error("group.kind_failed", kind=kind, group=name, stage="open", error=repr(exc))
                raise KindStopped(f"{kind}: could not start: {exc!r}") from exc
            if stop.is_set():
                return
        served = asyncio.create_task(telemetry.serve(workers[kinds[0]], name, cluster, stop, kinds=kinds))
        runs = {asyncio.create_task(run_kind(k), name=k): k for k in kinds}
        failed = await _first_failure(runs, stop, name, log)
        if failed:
            raise KindStopped(f"{failed[0]}: {failed[1]!r}" if failed[1] else f"{failed[0]} stopped on its own")
    finally:
        stop.set()
        for t in runs:
            t.cancel()
        if served is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(served, 5)
        for w in workers.values():
            with contextlib.suppress(Exception):
                await w.close()


def _check_group(kinds: list[str]) -> None:
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown worker kind {kind!r}; one of {', '.join(KINDS)}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"a kind twice in one group: {'+'.join(kinds)}")


async def _first_failure(runs: dict[asyncio.Task[None], str], stop: asyncio.Event, name: str,
                         log: Any) -> tuple[str, BaseException | None] | None:
    """Wait for ``stop`` or a kind's run to end, then stop them all: (the kind, its error) of the
    first that failed or stopped on its own, else ``None``."""
    failed: tuple[str, BaseException | None] | None = None
    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*runs, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    ended = [t for t in runs if t in done] if not stop.is_set() else []
    if ended:
        t = ended[0]
        error = None if t.cancelled() else t.exception()
        failed = (runs[t], error)
        log.error("group.kind_failed", kind=runs[t], group=name, stage="run", error=repr(error) if error else "stopped on its own")
    stop.set()  # every kind stops (a SIGTERM/SIGINT, or one of them failed)
    _, pending = await asyncio.wait(list(runs), timeout=STOP_TIMEOUT_S)
    for t in pending:
        log.warning("group.kind_slow_to_stop", kind=runs[t], group=name)
        t.cancel()
    for t, kind in runs.items():
        if failed is None and t not in pending and not t.cancelled() and t.exception() is not None:
            failed = (kind, t.exception())
            log.error("group.kind_failed", kind=kind, group=name, stage="stop", error=repr(t.exception()))
    return failed


async def _check_cluster(w: Worker, cluster: str) -> None:
    """A warning, not a refusal, when ``--cluster`` names no registered cluster: a worker may start
    before its cluster exists (an agent's ``--cluster`` registers it when new), but a typo served
    nothing, unsaid."""
    import structlog

    known = sorted(await w.store.clusters())
    if cluster not in known:
        structlog.get_logger("aios.worker").warning(
            "worker.unknown_cluster", cluster=cluster, known=known,
            note="no such cluster yet: it is served once registered (`blocks cluster add`, or a node agent's "
                 "--cluster); until then this worker serves nothing of it. A typo? `blocks cluster list`")


async def _run_kind(w: Worker, kind: str, cluster: str | None, stop: asyncio.Event) -> None:
    from ..workers.base import EpochGuard, run_consumers

    if cluster:
        await _check_cluster(w, cluster)
    if kind == "executor":
        from ..workers.executor import run as run_executor

        await run_executor(w, stop, cluster)
        return
    if kind == "mapper":
        from ..workers.mapper import run as run_mapper

        await run_mapper(w, stop)
        return
    if kind == "checker":
        from ..workers.checker import run as run_checker

        await run_checker(w, stop)
        return
    if kind == "metrics":
        from ..workers.collector import run as run_collector

        await run_collector(w, stop, cluster)
        return
    if kind == "autoscaler":
        from ..workers.autoscaler import run as run_autoscaler

        await run_autoscaler(w, stop, cluster)
        return
    if kind == "rebalancer":
        from ..workers.rebalancer import run as run_rebalancer

        await run_rebalancer(w, stop, cluster)
        return
    if kind == "parser":
        from ..workers import parser

        binds = parser.bindings(w)
    elif kind == "gateway":
        from ..workers import gateway

        binds = gateway.bindings(w)
    elif kind == "controller":
        from ..workers import controller, vcluster

        binds = controller.bindings(w, cluster) + controller.lifecycle_bindings(w) + vcluster.bindings(w)
    else:
        from ..agent import fleet

        binds = await fleet.started(w)  # what it runs is reported before it takes a command
    if kind in ("gateway", "controller"):
        w.inventory.prefetch = True
        # like kube-scheduler's cache sync: load the inventory before taking work, so the first
        # placements do not each pay for reading a cluster (other copies serve meanwhile)
        await _warm(w, cluster)
    settle_heap()
    if kind == "controller":
        from ..workers.health import HealthMonitor
        from ..workers.moves import MoveSweeper
        from ..workers.queue import QueueWalker
        from ..workers.reconciler import Reconciler

        await asyncio.gather(
            run_consumers(w, binds, stop), HealthMonitor(w).run(stop), vcluster.run_sweeps(w, stop, EpochGuard(w)),
            Reconciler(w).run(stop), QueueWalker(w).run(stop), MoveSweeper(w).run(stop),
        )
    elif kind == "gateway":
        from ..workers import gateway
        from ..workers.tenants import TenantDesk

        await asyncio.gather(run_consumers(w, binds, stop), gateway.run_timers(w, stop, EpochGuard(w)), TenantDesk(w).run(stop))
    else:
        await run_consumers(w, binds, stop)


async def _warm(w: Worker, cluster: str | None) -> None:
    import structlog

    log = structlog.get_logger("aios.worker")
    started = time.perf_counter()
    try:
        nodes = await asyncio.wait_for(w.inventory.warm(cluster), w.settings.warm_timeout_s)
    except Exception as exc:  # a cold cache is only slower: never fail (or stall) the worker for it
        log.warning("inventory.warm_failed", error=repr(exc))
        return
    log.info("inventory.warm", nodes=nodes, seconds=round(time.perf_counter() - started, 3))


def tune_gc(gen0: int) -> None:
    """Collect the youngest generation less often (``AIOS_GC_GEN0_THRESHOLD``). A worker holds
    large long-lived caches (every node's view) and allocates many short-lived containers per
    message; at Python's default of 700 it ran a collection every few messages and a full one
    (every cached object traversed) several times a second in a burst. Nearly all of its garbage
    is freed by reference counting anyway; what the collector is for (cycles) still goes, later."""
    if gen0 > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0, gen1, gen2)


def settle_heap() -> None:
    """Move every object alive now (modules, settings, the warmed inventory) out of the cyclic
    collector's reach (``gc.freeze``): they live as long as the process, and a full collection
    otherwise walks all of them again (30-50 ms each in a burst, measured in the core process; ~3 ms
    after). Objects made later are collected as usual; called when a kind has started (a group
    process calls it once per kind, each call taking what came since)."""
    gc.freeze()


def main() -> None:
    lean_imports()
    from ..settings import load as load_settings

    settings = load_settings()  # the process's one Settings, passed down to every kind
    configure_logging(settings.log_level)
    tune_gc(settings.gc_gen0_threshold)
    kind = sys.argv[1]
    cluster = sys.argv[2] if len(sys.argv) > 2 else None
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if "+" in kind:  # a group: every kind's own URLs
        kinds = kind.split("+")
        urls = group_urls(kinds, os.environ)

        def run() -> None:
            try:
                asyncio.run(run_group(kinds, urls, cluster, settings=settings))
            except KindStopped as exc:
                print(f"worker group {kind}: {exc}", file=sys.stderr)
                sys.exit(1)
    else:
        nats_url, redis_url = os.environ["AIOS_NATS_URL"], os.environ["AIOS_REDIS_URL"]

        def run() -> None:
            asyncio.run(run_worker(kind, nats_url, redis_url, cluster, settings=settings))

    prof_dir = os.environ.get("AIOS_PROFILE_DIR")
    if prof_dir:  # a sampling profile of this worker, written when it stops (docs/benchmarks.md)
        _profiled(prof_dir, kind, run)
        return
    run()


def _profiled(prof_dir: str, kind: str, run: Any) -> None:
    """Run under pyinstrument (a dev dependency); ``<kind>-<pid>.txt`` (the call tree) and
    ``.pyisession`` (``pyinstrument --load``) go into ``prof_dir``."""
    from pyinstrument import Profiler

    prof = Profiler(interval=0.0005)
    prof.start()
    try:
        run()
    finally:
        prof.stop()
        os.makedirs(prof_dir, exist_ok=True)  # a directory that does not exist yet is made (nothing was written before)
        base = os.path.join(prof_dir, f"{kind}-{os.getpid()}")
        with open(base + ".txt", "w") as f:
            f.write(prof.output_text(unicode=False, color=False))
        if prof.last_session is not None:
            prof.last_session.save(base + ".pyisession")


if __name__ == "__main__":
    main()
