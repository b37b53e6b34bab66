"""Run policy code in child processes: Starlark scriptlets (with an address-space limit) and
user Python policies (``registry:NAME``, ``NAME.py``).

starlark-pyo3 has a time limit (polled) but no heap limit, and starlark-rust aborts the process
when an allocation fails, so a tenant's ``list(range(10**9))`` would kill a worker. Here each call
runs in a spawned child process with ``RLIMIT_AS`` set: a scriptlet that allocates past the limit
kills only that child; the call fails with a clear reason and the process is replaced.

A Python call cannot be stopped in a thread: one that spins for ever held its thread (and the
GIL's share) until the worker restarted. In a child process it is stopped at its limit: the
process is killed and replaced, the step fails, and the worker is whole again at once.

A :class:`SandboxPool` is ``workers`` slots, each one child process (a one-process executor) that
runs its calls in order; a call names the slot it runs in (``route``: the calls of one policy
instance always go to the same process, which keeps the instance between calls) or takes the
least busy one. Each child writes the id of the call it starts into a shared counter, so a call at
its limit knows whether it ran (its process is killed: ``SandboxTimeout``) or never started (the
slot was busy: ``SandboxBusy``, nothing killed). A call whose process was stopped for another
call's overrun, or died running another call, is submitted again to the fresh process within its
own time limit.

The child compiles each (name, source) once and keeps instances per (rule, settings, parameters)
(Starlark) or per instance id (Python), so the cost per call is the round trip of the payload
(pickled), not a compile.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ..schemas.records import JSONObject

#: how long a call may wait for its process to start (a spawned child imports this package) on top
#: of its own time limit, which counts from when it starts there
START_ALLOWANCE_S = 10.0
POLL_S = 0.02


class SandboxCrash(RuntimeError):
    """The child process running the call died (memory limit, abort, ``os._exit``, a segfault)."""


class SandboxTimeout(SandboxCrash):
    """The call ran past its time limit; its process was killed (and will be replaced)."""


class SandboxBusy(SandboxCrash):
    """The call did not start within its time limit: its process was busy with other calls."""


class SandboxUnsendable(Exception):
    """The call's arguments could not be pickled to its process: it never ran there (nothing of
    the policy's was called). The message names what did not pickle."""


# -- child side ---------------------------------------------------------------------------------
_classes: dict[str, type] = {}
_instances: dict[tuple[str, str, str], Any] = {}
_current: Any = None  # this child's shared counter: the id of the call it runs (set by _init)


def _init(memory_mb: int, current: Any, preload: tuple[str, ...]) -> None:
    global _current
    _current = current
    import importlib

    for module in preload:  # before any call: an import is no call's time
        importlib.import_module(module)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the worker's terminal is the worker's
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True, name="sandbox-parent").start()
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _orphaned(parent: int) -> None:
    """Exit once the worker is gone (killed, restarted): a call spinning here would outlive it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _run(call_id: int, fn: Callable[..., Any], args: Any) -> Any:
    """``fn(*args)`` in the child; ``args``: a :class:`_Payload` where it was sent, its tuple here."""
    if _current is not None:
        _current.value = call_id
    return fn(*args)


class _Payload:
    """A call's arguments, pickled where the executor sends the call (its queue's feeder thread):
    arguments that do not pickle fail the call's future with :class:`SandboxUnsendable`, naming
    which part did not (the executor's own pickling error is a bare ``TypeError`` that read as if
    the policy had raised it). It arrives in the child as the plain tuple."""

    __slots__ = ("args", "names")

    def __init__(self, args: tuple[Any, ...], names: tuple[str, ...]):
        self.args, self.names = args, names

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            blob = pickle.dumps(self.args, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            where, exc = _unpicklable(self.args, self.names)
            raise SandboxUnsendable(f"{where} cannot be sent to its process: {_failure(exc)}") from None
        return pickle.loads, (blob,)


def _unpicklable(args: tuple[Any, ...], names: tuple[str, ...]) -> tuple[str, BaseException]:
    """The deepest part of ``args`` that does not pickle, as ``input_data['payload']['x']``, and
    why (only once pickling the whole has failed)."""

    def find(value: Any, where: str, depth: int) -> tuple[str, BaseException] | None:
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            return None
        except Exception as exc:
            found: tuple[str, BaseException] = (where, exc)
        items: Any = ()
        if depth < 64 and isinstance(value, Mapping):
            items = list(value.items())
        elif depth < 64 and isinstance(value, (list, tuple)):
            items = enumerate(value)
        for k, v in items:
            deeper = find(v, f"{where}[{k!r}]", depth + 1)
            if deeper is not None:
                return deeper
        return found

    for i, arg in enumerate(args):
        bad = find(arg, names[i] if i < len(names) else f"argument {i}", 0)
        if bad is not None:
            return bad
    return "the call's arguments", TypeError("they do not pickle")


def _call(key: str, source: str, name: str, rule_id: str, settings: JSONObject, parameters: JSONObject,
          input_data: Mapping[str, object], context: JSONObject) -> tuple[Any, JSONObject, list[list[str]]]:
    from .starlark_runtime import compile_policy

    cls = _classes.get(key)
    if cls is None:
        cls = _classes[key] = compile_policy(source, name)
    ikey = (key, rule_id, repr((settings, parameters)))
    inst = _instances.get(ikey)
    if inst is None:
        if len(_instances) > 1024:
            _instances.clear()
        inst = _instances[ikey] = cls(rule_id, settings, parameters)
    try:
        result = inst.eval(parameters, input_data, context)
    finally:
        logs = [list(line) for line in getattr(inst, "logs", [])]
    return result, context, logs


_py_instances: OrderedDict[int, Any] = OrderedDict()
MAX_PY_INSTANCES = 4096


def _py_class(key: str, source: str, label: str) -> type:
    from .pysource import policy_class_from_source

    cls = _classes.get(key)
    if cls is None:
        if len(_classes) > 1024:  # a bound: sources are few
            _classes.clear()
        cls = _classes[key] = policy_class_from_source(source, label)
    return cls


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _py_build(key: str, source: str, label: str, iid: int, rule_id: str, settings: JSONObject,
              parameters: JSONObject) -> tuple[str | None, str]:
    """Compile the source (once per process) and, for ``iid`` > 0, build the instance; -> (None,
    the class's name), or (why it does not load, "")."""
    try:
        cls = _py_class(key, source, label)
        if iid > 0 and iid not in _py_instances:
            _py_instances[iid] = cls(rule_id, settings, parameters)
            if len(_py_instances) > MAX_PY_INSTANCES:
                _py_instances.popitem(last=False)
    except BaseException as exc:  # SystemExit & co from policy code: its failure
        return _failure(exc), ""
    return None, cls.__name__


def _py_call(key: str, source: str, label: str, iid: int, rule_id: str, settings: JSONObject, init_parameters: JSONObject,
             parameters: JSONObject, input_data: Mapping[str, object], context: JSONObject
             ) -> tuple[str, Any, JSONObject, list[list[str]]]:
    """-> (``ok``, the pickled result, the context after, the printed lines), or (``load`` /
    ``raised`` / ``wrong_shape``, the reason, the context after, the printed lines)."""
    from .pysource import _printed

    lines: list[list[str]] = []
    if iid not in _py_instances:  # built in a process since replaced: build it again here
        error, _ = _py_build(key, source, label, iid, rule_id, settings, init_parameters)
        if error is not None:
            return "load", error, context, lines
    inst = _py_instances[iid]
    _py_instances.move_to_end(iid)
    _printed.lines = lines
    try:
        result = inst.eval(parameters, input_data, context)
    except BaseException as exc:  # never out of the child but as an answer
        return "raised", _failure(exc), context, lines
    finally:
        _printed.lines = None
    try:
        blob = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # e.g. an object of the policy's own class
        return "wrong_shape", f"unreadable result: {_failure(exc)}", context, lines
    return "ok", blob, context, lines


# -- parent side --------------------------------------------------------------------------------
class _Slot:
    """One child process (started on its first call) and the id of the call it last started."""

    def __init__(self, memory_mb: int, preload: tuple[str, ...]):
        ctx = multiprocessing.get_context("spawn")
        self.current = ctx.Value("q", 0, lock=False)
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=ctx, initializer=_init, initargs=(memory_mb, self.current, preload)
        )
        self.inflight = 0
        self.procs: list[Any] = []  # its process (kept: the executor forgets it once it dies)
        self.stopped = False  # killed on purpose (a call's overrun), not died of its own

    def kill(self, deliberate: bool = True) -> None:
        """``deliberate``: for a call's overrun (its other calls run again elsewhere), not the
        clean-up of a process that died of its own."""
        self.stopped = self.stopped or deliberate
        procs = {p.pid: p for p in [*self.procs, *(getattr(self.executor, "_processes", None) or {}).values()]}.values()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        self.executor.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.join(2)


def _how_it_died(procs: list[Any]) -> str:
    for proc in procs:
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                return f" (signal {signal.Signals(-code).name})"
            except ValueError:
                return f" (signal {-code})"
        if code is not None:
            return f" (exit code {code})"
    return ""


class SandboxPool:
    def __init__(self, workers: int | None = None, memory_mb: int | None = None, what: str = "scriptlet",
                 start_allowance_s: float = START_ALLOWANCE_S, preload: tuple[str, ...] | None = None):
        """``workers``, ``memory_mb`` (0: no limit): AIOS_STARLARK_PROCESSES,
        AIOS_STARLARK_MEMORY_MB unless given. ``what``: the calls' name in reasons. ``preload``:
        modules a process imports when it starts (the runtime of its calls)."""
        if preload is None:
            preload = (f"{__package__}.pysource",) if what == "policy" else (f"{__package__}.starlark_runtime",)
        self.preload = preload
        self.start_allowance_s = start_allowance_s
        from ..settings import load as load_settings  # here: a policy process need not import it

        s = load_settings()
        self.workers = s.starlark_processes if workers is None else workers
        self.memory_mb = s.starlark_memory_mb if memory_mb is None else memory_mb
        self.what = what
        self._slots: list[_Slot | None] = [None] * self.workers
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def pids(self) -> list[int]:
        """The process ids of the live children (all started on the pool's first call)."""
        with self._lock:
            slots = [s for s in self._slots if s is not None]
        return [p.pid for s in slots for p in list((getattr(s.executor, "_processes", None) or {}).values())
                if p.is_alive()]

    def _submit(self, route: str | None, fn: Callable[..., Any], args: tuple[Any, ...], names: tuple[str, ...]
                ) -> tuple[int, _Slot, int, concurrent.futures.Future[Any]]:
        with self._lock:
            if route is None:  # the least busy slot (a started one first)
                i = min(range(self.workers), key=lambda j: (self._slots[j].inflight if self._slots[j] else 0.5, j))  # type: ignore[union-attr]
            else:
                i = int.from_bytes(hashlib.blake2b(route.encode(), digest_size=4).digest(), "big") % self.workers
            if all(s is None for s in self._slots):  # first use: start them all (their imports overlap)
                for j in range(self.workers):
                    self._slots[j] = self._started()
            slot = self._slots[i]
            if slot is None:
                slot = self._slots[i] = _Slot(self.memory_mb, self.preload)
            call_id = next(self._ids)
            fut = slot.executor.submit(_run, call_id, fn, _Payload(args, names))  # in id order: a slot runs them in order
            if not slot.procs:
                slot.procs = list((getattr(slot.executor, "_processes", None) or {}).values())
            slot.inflight += 1
        return i, slot, call_id, fut

    def _stop(self, i: int, slot: _Slot, deliberate: bool = True) -> None:
        """Kill the slot's process; its replacement starts now (the next call does not wait)."""
        with self._lock:
            if self._slots[i] is slot:
                self._slots[i] = self._started()
        slot.kill(deliberate)

    def _watch(self, i: int, slot: _Slot, call_id: int, fut: concurrent.futures.Future[Any], timeout_s: float) -> None:
        """A call given up before it started that could not be withdrawn (next in its process's
        queue): it is stopped at its limit all the same, or it could hold its process for ever."""
        while not fut.done() and not slot.stopped and slot.current.value < call_id:
            time.sleep(POLL_S)
        try:
            fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            if not slot.stopped:
                self._stop(i, slot)
        except BaseException:
            pass

    def _started(self) -> _Slot:
        """A new slot whose process is starting (a no-op submitted: the executor starts on a call)."""
        fresh = _Slot(self.memory_mb, self.preload)
        fresh.executor.submit(int)
        fresh.procs = list((getattr(fresh.executor, "_processes", None) or {}).values())
        return fresh

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, route: str | None = None,
            names: tuple[str, ...] = ()) -> Any:
        """``fn(*args)`` in a child process, ``timeout_s`` from when it starts there (a process
        starting up does not count against it). Raises SandboxTimeout (it ran past the limit: its
        process was killed), SandboxBusy (it did not start within ``timeout_s`` +
        ``start_allowance_s``), SandboxCrash (its process died running it), SandboxUnsendable
        (``args`` do not pickle: ``names``, the arguments' names, say which), or what ``fn``
        raised."""
        start_by = time.monotonic() + timeout_s + self.start_allowance_s
        while True:
            i, slot, call_id, fut = self._submit(route, fn, args, names)
            started = 0.0
            try:
                while True:
                    if not started and slot.current.value >= call_id:
                        started = time.monotonic()
                    limit = started + timeout_s if started else start_by
                    wait = limit - time.monotonic()
                    try:
                        return fut.result(timeout=max(0.0, wait if started else min(wait, POLL_S)))
                    except concurrent.futures.TimeoutError:
                        if time.monotonic() < limit:
                            continue
                    if started or slot.current.value >= call_id:  # it started: stop it
                        self._stop(i, slot)
                        raise SandboxTimeout(f"timed out after {timeout_s:g}s (its process was stopped)") from None
                    if not fut.cancel():
                        threading.Thread(target=self._watch, args=(i, slot, call_id, fut, timeout_s), daemon=True,
                                         name="sandbox-watch").start()
                    raise SandboxBusy(f"timed out after {timeout_s:g}s without starting: its {self.what} process was "
                                      "busy with other calls") from None
            except (BrokenProcessPool, concurrent.futures.CancelledError):
                procs = slot.procs
                for proc in procs:
                    proc.join(1)
                mine = not slot.stopped and slot.current.value == call_id
                self._stop(i, slot, deliberate=False)
                if mine:
                    how = _how_it_died(procs)
                    hint = f"memory limit {self.memory_mb} MiB exceeded, or it aborted" if self.memory_mb else ""
                    raise SandboxCrash(f"its process died{how}" + (f" ({hint})" if hint else "")) from None
                if time.monotonic() >= start_by:
                    raise SandboxBusy(f"timed out after {timeout_s:g}s without starting: its {self.what} process "
                                      "was stopped for another call") from None
                # stopped for another call's overrun, or died running another call: again, afresh
            finally:
                with self._lock:
                    slot.inflight -= 1

    def call(self, source: str, name: str, rule_id: str, settings: JSONObject, parameters: JSONObject,
             input_data: Mapping[str, object], context: JSONObject, timeout_s: float) -> tuple[Any, JSONObject, list[list[str]]]:
        """One Starlark scriptlet call (``_call`` in a child)."""
        key = f"{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
        try:
            result: tuple[Any, JSONObject, list[list[str]]] = self.run(
                _call, (key, source, name, rule_id, settings, parameters, input_data, dict(context)), timeout_s,
                names=_CALL_ARGS)
        except SandboxTimeout:
            raise SandboxCrash(f"the scriptlet's process did not answer within {timeout_s:g}s and was killed") from None
        except SandboxBusy:
            raise
        except SandboxCrash as exc:
            raise SandboxCrash(f"the scriptlet's {str(exc).removeprefix('its ')}") from None
        return result

    def close(self) -> None:
        with self._lock:
            slots, self._slots = self._slots, [None] * self.workers
        for slot in slots:
            if slot is not None:
                slot.kill()


_shared: dict[str, SandboxPool] = {}
_shared_lock = threading.Lock()


def shared(kind: str = "starlark") -> SandboxPool:
    """The worker's pool for ``kind``: ``starlark`` (AIOS_STARLARK_PROCESSES, with the memory
    limit) or ``python`` (AIOS_PYTHON_POLICY_PROCESSES, no memory limit)."""
    with _shared_lock:
        pool = _shared.get(kind)
        if pool is None:
            pool = _shared[kind] = new_pool(kind)
        return pool


def new_pool(kind: str, workers: int | None = None) -> SandboxPool:
    """A pool for ``kind`` as :func:`shared` makes it, of ``workers`` processes (the setting's
    number unless given): ``blocks policy run`` has its own of 1, started by its one call."""
    if kind == "python":
        from ..settings import load as load_settings

        return SandboxPool(workers=load_settings().python_policy_processes if workers is None else workers,
                           memory_mb=0, what="policy")
    return SandboxPool(workers=workers)


def sandboxed_class(source: str, name: str, timeout_s: float, pool: Callable[[], SandboxPool] | None = None) -> type:
    """A seed-shaped class whose ``eval`` runs the scriptlet in the sandbox pool (``pool``: the
    worker's shared one unless given)."""
    get = pool or shared

    class SandboxedStarlarkPolicy:
        def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
            self.rule_id = str(rule_id)
            self.settings = settings or {}
            self.parameters = parameters or {}
            self.logs: list[list[str]] = []

        def eval(self, parameters: JSONObject, input_data: Mapping[str, object], context: JSONObject | None) -> Any:
            result, ctx_after, self.logs = get().call(
                source, name, self.rule_id, self.settings, self.parameters, input_data, dict(context or {}), timeout_s
            )
            if context is not None:
                for k in [k for k in context if k not in ctx_after]:
                    del context[k]
                context.update(ctx_after)
            return result

    SandboxedStarlarkPolicy.__name__ = f"Starlark[{name}]"
    return SandboxedStarlarkPolicy


class SandboxLoadError(Exception):
    """A sandboxed Python source that does not compile or whose constructor fails (in the child)."""


class SandboxFailure(Exception):
    """A sandboxed Python call's failure: ``kind`` (``raised``, ``wrong_shape``, ``load``, as
    ``PolicyFailed.kind``) and ``reason``."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


_iids = itertools.count(1)
#: the least time a Python policy's build (its source compiled, an instance's ``__init__``) gets
#: in its process, whatever the call limit: the first build may wait for the process to start
LOAD_TIMEOUT_FLOOR_S = 10.0
#: the names of ``_call``'s and ``_py_call``'s arguments, for what did not pickle
_CALL_ARGS = ("key", "source", "name", "rule_id", "settings", "parameters", "input_data", "context")
_PY_CALL_ARGS = ("key", "source", "label", "iid", "rule_id", "settings", "init_parameters", "parameters",
                 "input_data", "context")


def python_sandboxed_class(source: str, label: str, timeout_s: float, pool: Callable[[], SandboxPool] | None = None) -> type:
    """A seed-shaped class whose instances live in a child process of the ``python`` pool: the
    source compiles there (checked here, once), each instance is built there and called there
    (always in the same process, which keeps its state between calls until that process is
    stopped). Nothing of the source runs in this process."""
    get = pool or (lambda: shared("python"))
    key = f"{label}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    # building (compile, __init__) may wait for a process to start and import: a short call limit
    # (AIOS_POLICY_TIMEOUT_S 0.2) failed a busy machine's loads, so they have a floor of their own
    load_s = max(timeout_s, LOAD_TIMEOUT_FLOOR_S)
    error, cls_name = get().run(_py_build, (key, source, label, 0, "", {}, {}), load_s)
    if error is not None:
        raise SandboxLoadError(error)

    class SandboxedPythonPolicy:
        sandboxed = True

        def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
            self.rule_id = str(rule_id)
            self.settings = settings or {}
            self.parameters = parameters or {}
            self.iid = next(_iids)
            self.logs: list[list[str]] = []
            built, _ = get().run(_py_build, (key, source, label, self.iid, self.rule_id, self.settings, self.parameters),
                                 load_s, route=str(self.iid))
            if built is not None:
                raise SandboxLoadError(built)

        def call(self, parameters: JSONObject, input_data: Mapping[str, object], context: JSONObject | None,
                 limit_s: float | None = None) -> tuple[str, Any, list[list[str]]]:
            """-> (status, pickled result or reason, printed lines) as ``_py_call``; raises the
            pool's SandboxTimeout / SandboxBusy / SandboxCrash / SandboxUnsendable."""
            status, value, ctx_after, lines = get().run(
                _py_call, (key, source, label, self.iid, self.rule_id, self.settings, self.parameters, parameters,
                           input_data, dict(context or {})),
                timeout_s if limit_s is None else limit_s, route=str(self.iid), names=_PY_CALL_ARGS)
            if context is not None:
                for k in [k for k in context if k not in ctx_after]:
                    del context[k]
                context.update(ctx_after)
            return status, value, lines

        def eval(self, parameters: JSONObject, input_data: Mapping[str, object], context: JSONObject | None) -> Any:
            status, value, self.logs = self.call(parameters, input_data, context)
            if status == "ok":
                return pickle.loads(value)
            raise SandboxFailure(status, value)

    SandboxedPythonPolicy.__name__ = SandboxedPythonPolicy.__qualname__ = cls_name  # the source's class
    return SandboxedPythonPolicy
