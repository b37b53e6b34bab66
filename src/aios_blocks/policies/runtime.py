"""Loading and running policies in the seed-000 class shape.

``policyRuleURI`` forms:

* ``builtin:cluster-rank``, ``builtin:binpack``, ``builtin:spread``, ``builtin:round-robin``,
  ``builtin:least-inflight``, ``builtin:least-queue``, ``builtin:target-inflight``,
  ``builtin:queue-depth``, ``builtin:probe-threshold``, and the FGD paper's ``builtin:random``,
  ``builtin:dot-product``, ``builtin:gpu-packing``, ``builtin:gpu-clustering``, ``builtin:best-fit``,
  ``builtin:fgd`` (docs/trace.md), ``builtin:preempt-min`` (docs/priority.md), ``builtin:rebalance-min`` (docs/rebalance.md) - the built-ins;
* ``package.module:ClassName`` - an importable class (trusted, installed by the operator);
* ``registry:NAME`` or ``registry:NAME@VERSION`` - Python source stored with ``blocks policy add``;
  a URI ending in ``.py`` means the registry entry named by the file's stem.

Python policy sources (``registry:``, ``NAME.py``) run, by default (AIOS_PYTHON_POLICY_SANDBOX=
process), in child processes (policies/sandbox.py): a call past its time limit has its process
killed and replaced, so the worker is whole again at once; their instances live there. With
``thread``, they run in the worker's process, each call in a worker thread with a time limit (a
call that never returns keeps its thread busy: the time limit frees the step, not the thread).
Either way a call that raises, overruns or returns the wrong shape raises :class:`PolicyFailed`
for that step only. ``module:Class`` policies (installed by the operator) run in threads. The
built-ins (this package's own code, bounded by their input) run inline on the event loop: no
thread hop, no time limit, the same failure rules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import msgspec

from ..schemas.errors import PolicyFailed
from ..schemas.policy_io import PolicySource
from ..schemas.records import JSON, JSONObject
from ..settings import load as load_settings
from . import contract, uris
from .builtin.autoscale import QueueDepthPolicy, TargetInflightPolicy
from .builtin.balancer import LeastInflightPolicy, LeastQueuePolicy, RoundRobinPolicy
from .builtin.cluster_rank import ClusterRankPolicy
from .builtin.fgd_plus import POLICIES as FGD_PLUS_POLICIES
from .builtin.frag import POLICIES as FRAG_POLICIES
from .builtin.preempt import PreemptMinPolicy
from .builtin.rebalance import RebalanceMinPolicy
from .builtin.resource import BinPackPolicy, SpreadPolicy
from .builtin.stability import ProbeThresholdPolicy
from .pysource import MAX_PRINT_CHARS as MAX_PRINT_CHARS
from .pysource import MAX_PRINT_LINES, _printed, policy_class_from_source
from .sandbox import (
    START_ALLOWANCE_S,
    SandboxBusy,
    SandboxCrash,
    SandboxLoadError,
    SandboxPool,
    SandboxTimeout,
    SandboxUnsendable,
    new_pool,
    python_sandboxed_class,
    sandboxed_class,
)

BUILTINS: dict[str, type] = {
    "builtin:cluster-rank": ClusterRankPolicy,
    "builtin:binpack": BinPackPolicy,
    "builtin:spread": SpreadPolicy,
    "builtin:round-robin": RoundRobinPolicy,
    "builtin:least-inflight": LeastInflightPolicy,
    "builtin:least-queue": LeastQueuePolicy,
    "builtin:target-inflight": TargetInflightPolicy,
    "builtin:queue-depth": QueueDepthPolicy,
    "builtin:probe-threshold": ProbeThresholdPolicy,
    # the GPU-sharing baselines of the FGD paper (docs/trace.md)
    **FRAG_POLICIES,
    # ours: FGD with a look-ahead measure (policies/builtin/fgd_plus.py, docs/trace.md)
    **FGD_PLUS_POLICIES,
    # the default preemption policy (policies/builtin/preempt.py, docs/priority.md)
    "builtin:preempt-min": PreemptMinPolicy,
    # the default rebalancer policy (policies/builtin/rebalance.py, docs/rebalance.md)
    "builtin:rebalance-min": RebalanceMinPolicy,
}

#: (name, version) -> source record; the runtime asks this to fetch registry sources.
SourceLookup = Callable[[str, int | None], Awaitable[PolicySource | None]]


def stateless(uri: str) -> bool:
    """A policy that never reads or writes its ``context`` (the built-ins): its callers need not
    load or save one."""
    return uri in BUILTINS


class TrackingDict(dict[str, JSON]):
    """The ``context`` a policy sees: a plain dict that remembers what the call changed."""

    def __init__(self, data: JSONObject):
        super().__init__(data)
        self._orig = {k: repr(v) for k, v in data.items()}

    def changes(self) -> tuple[JSONObject, list[str]]:
        changed = {k: v for k, v in self.items() if self._orig.get(k) != repr(v)}
        deleted = [k for k in self._orig if k not in self]
        return changed, deleted


def registry_name(uri: str) -> tuple[str, int | None] | None:
    """``registry:NAME[@V]`` or ``something/name.py`` -> (NAME, V); None for other URIs."""
    if uri.startswith("registry:"):
        rest = uri[len("registry:") :]
        if "@" in rest:
            name, _, ver = rest.partition("@")
            return name, int(ver)
        return rest, None
    if uri.endswith((".py", ".star")):
        return os.path.splitext(os.path.basename(uri))[0], None
    return None


def language_of(path: str) -> str:
    return "starlark" if path.endswith(".star") else "python"


def compile_source(source: str, language: str, label: str, timeout_s: float | None = None,
                   python_sandbox: str | None = None, pools: Callable[[str], SandboxPool] | None = None) -> type:
    """Source -> a class in the seed's shape (Python: the one class with ``eval``, or with
    ``python_sandbox`` "process" (AIOS_PYTHON_POLICY_SANDBOX unless given) a class whose instances
    run in a child process, ``timeout_s`` a call; Starlark: a sandboxed scriptlet, seed-000 ``eval``
    or LXD ``instance_placement`` form). ``pools``: kind (``python``, ``starlark``) -> the
    sandbox pool its calls run in (the worker's shared ones unless given)."""
    if language == "starlark":
        # imported here: the starlark extension (~4 MiB per process) only where a policy is Starlark
        from .starlark_runtime import compile_policy

        cls = compile_policy(source, label)  # parses and resolves names without running anything
        # AIOS_STARLARK_SANDBOX "process" (default): calls run in child processes with a memory
        # limit (policies/sandbox.py); "inline": in the worker's process (faster, but a huge
        # allocation aborts the worker). Read when a policy compiles, never at import.
        s = load_settings()
        if s.starlark_sandbox == "inline":
            return cls
        return sandboxed_class(source, label, timeout_s=s.starlark_call_timeout_s,
                               pool=None if pools is None else lambda: pools("starlark"))
    if language != "python":
        raise ValueError(f"{label}: unknown policy language {language!r}")
    s = load_settings()
    if (python_sandbox or s.python_policy_sandbox) == "process":
        return python_sandboxed_class(source, label, s.policy_timeout_s if timeout_s is None else timeout_s,
                                      None if pools is None else lambda: pools("python"))
    return policy_class_from_source(source, label)


POLICY_THREADS = 16


def _captured(lines: list[list[str]], started: list[bool], fn: Callable[..., Any], *args: Any) -> Any:
    """Run one policy call in this (pool) thread with its prints going to ``lines``; ``started``
    tells the caller, at its time limit, whether the call ever began."""
    started.append(True)
    _printed.lines = lines
    try:
        return _guarded(fn, *args)
    finally:
        _printed.lines = None


_PACK = msgspec.msgpack.Encoder()


def fingerprint(value: Any) -> bytes | str:
    """What tells a rule's settings (or parameters) from another's, for the policy instances'
    key: their MessagePack encoding (about 10 us for ``fgd-plus``'s workload of 35 shapes, where
    ``repr`` took about 90, once per policy call), their ``repr`` where it cannot encode them.
    MessagePack keeps apart what ``repr`` does (1 and 1.0 and True, None and NaN, "1" and 1 as
    keys) but lists, tuples and sets with the same items, which JSON input never holds."""
    try:
        return _PACK.encode(value)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        return repr(value)


class PolicyRuntime:
    def __init__(
        self,
        lookup: SourceLookup | None = None,
        timeout_s: float | None = None,
        max_instances: int = 4096,
        allow_files: bool = False,
        python_sandbox: str | None = None,
        processes: int | None = None,
    ):
        """``processes``: its own sandbox pools of that many processes each, started by the first
        call that needs one and stopped by :meth:`close` (``blocks policy run``: 1, where the
        worker's shared pools start AIOS_PYTHON_POLICY_PROCESSES at once for a single call)."""
        #: read ``*.py`` URIs from the local disk (``blocks policy run`` only; workers use the registry)
        self.allow_files = allow_files
        self.processes = processes
        self._own_pools: dict[str, SandboxPool] = {}
        self._own_lock = threading.Lock()
        self.lookup = lookup
        s = load_settings()
        self.timeout_s = s.policy_timeout_s if timeout_s is None else timeout_s
        #: "process" or "thread": where Python sources run (AIOS_PYTHON_POLICY_SANDBOX unless given)
        self.python_sandbox = python_sandbox or s.python_policy_sandbox
        self._classes: dict[tuple[str, int | None, str], type] = {}
        self._instances: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._max_instances = max_instances
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=POLICY_THREADS, thread_name_prefix="policy")
        #: calls past their time limit whose thread still runs them (a timed-out Python call cannot
        #: be stopped): when they hold every pool thread, a new call never starts
        self.overrunning = 0
        self._overrun_lock = threading.Lock()

    def _pools(self) -> Callable[[str], SandboxPool] | None:
        """compile_source's ``pools``: this runtime's own (``processes``), else None (the shared)."""
        if self.processes is None:
            return None
        size = self.processes

        def pool(kind: str) -> SandboxPool:
            with self._own_lock:
                if kind not in self._own_pools:
                    self._own_pools[kind] = new_pool(kind, size)
                return self._own_pools[kind]

        return pool

    def close(self) -> None:
        """Stop the processes of this runtime's own pools (``processes``); the shared are the worker's."""
        with self._own_lock:
            pools, self._own_pools = list(self._own_pools.values()), {}
        for pool in pools:
            pool.close()

    def forget(self, name: str) -> None:
        """Drop cached classes/instances of a registry policy (on ``aios.policy.NAME.updated``)."""
        for key in [k for k in self._classes if k[0] == f"registry:{name}"]:
            del self._classes[key]
        for key in [k for k in self._instances if k[1] == f"registry:{name}"]:
            del self._instances[key]

    async def resolve(self, uri: str, version: int | None = None, inline: bool = False) -> tuple[type, str, int | None]:
        """-> (class, cache name, version) for a policyRuleURI. ``inline``: a Python source's class
        in this process, whatever ``python_sandbox`` says (the executor's per-task loadBalancer,
        which has its own inline time limit)."""
        if uri in BUILTINS:
            return BUILTINS[uri], uri, None
        if uri.startswith("builtin:"):  # e.g. a component stored before the parser refused it
            raise ValueError(f"unknown built-in policy {uri!r}; the built-ins are {uris.known_builtins()}")
        key: tuple[str, int | None, str]
        mode = "thread" if inline else self.python_sandbox
        if self.allow_files and uri.endswith((".py", ".star")) and os.path.exists(uri):  # noqa: ASYNC240
            key = (uri, None, mode)
            if key not in self._classes:
                with open(uri) as f:  # noqa: ASYNC230 - CLI-only, once per file
                    self._classes[key] = compile_source(f.read(), language_of(uri), uri, self.timeout_s, mode,
                                                        self._pools())
            return self._classes[key], uri, None
        reg = registry_name(uri)
        if reg is not None:
            name, pinned = reg
            version = pinned if pinned is not None else version
            if self.lookup is None:
                raise ValueError(f"{uri}: no policy registry available")
            key = (f"registry:{name}", version, mode)
            if version is not None and key in self._classes:
                return self._classes[key], key[0], version
            try:
                record = await self.lookup(name, version)
            except Exception as exc:  # the registry's store (Redis) did not answer: not the policy's fault
                raise RegistryUnavailable(f"{type(exc).__name__}: {exc}") from exc
            if record is None:
                raise ValueError(f"policy {name!r} (version {version or 'latest'}) is not in the registry")
            key = (f"registry:{name}", int(record["version"]), mode)
            if key not in self._classes:  # compile off the loop: a top level may be slow
                self._classes[key] = await asyncio.get_running_loop().run_in_executor(
                    self._pool, compile_source, record["source"], record.get("language", "python"), f"{name}-v{key[1]}",
                    self.timeout_s, mode, self._pools(),
                )
            return self._classes[key], key[0], key[1]
        if ":" in uri:
            mod_name, _, cls_name = uri.partition(":")
            key = (uri, None, "thread")
            if key not in self._classes:
                self._classes[key] = getattr(importlib.import_module(mod_name), cls_name)
            return self._classes[key], uri, None
        raise ValueError(f"unknown policyRuleURI {uri!r} (use builtin:..., module:Class, registry:NAME or NAME.py)")

    async def instance(self, rule: dict[str, Any], rule_id: str, inline: bool = False) -> tuple[Any, str, int | None]:
        cls, cname, version = await self.resolve(rule["policyRuleURI"], rule.get("version"), inline)
        settings, parameters = rule.get("settings") or {}, rule.get("parameters") or {}
        if cname in BUILTINS and getattr(cls, "shareable", False):
            # one instance for every block of the rule (as ``blocks trace replay --in-process``
            # has): building fgd-plus's workload tables per block was a sixth to a third of a
            # controller's placement CPU on the GPU trace (docs/trace.md "Live vs Ray")
            rule_id = cname
        key = (rule_id, cname, version, fingerprint(settings), fingerprint(parameters), getattr(cls, "sandboxed", False))
        inst = self._instances.get(key)
        if inst is None:
            if cname in BUILTINS:
                inst = _guarded(cls, rule_id, settings, parameters)
            else:
                # constructors are policy code too: off the event loop, under the caller's time limit
                inst = await asyncio.get_running_loop().run_in_executor(self._pool, _guarded, cls, rule_id, settings, parameters)
            self._instances[key] = inst
            if len(self._instances) > self._max_instances:
                self._instances.popitem(last=False)
        else:
            self._instances.move_to_end(key)
        return inst, cname, version

    async def invoke(
        self,
        rule: dict[str, Any],
        rule_id: str,
        input_data: Mapping[str, object],
        context: JSONObject | None = None,
        trace: MutableMapping[str, object] | None = None,
    ) -> Any:
        """Run one policy call with the seed's arguments. Raises PolicyFailed, never anything else.
        ``trace`` (optional) receives ``version`` and the scriptlet's ``logs`` of this call."""
        action = str(input_data.get("action", "?"))
        name = rule.get("name", "?")
        builtin = rule.get("policyRuleURI") in BUILTINS
        inst = await self._loaded(rule, rule_id, name, action, builtin)
        params = rule.get("parameters") or {}
        ctx = context if context is not None else {}
        printed: list[list[str]] = []
        started: list[bool] = []
        try:
            try:
                if builtin:  # our own code: inline, no thread hop (~0.1 ms a call) and no time limit
                    result = _guarded(inst.eval, params, input_data, ctx)
                elif getattr(inst, "sandboxed", False):  # in its process, stopped at the limit
                    result = await self._sandboxed(inst, name, action, params, input_data, ctx, printed)
                else:
                    cfut = self._pool.submit(_captured, printed, started, inst.eval, params, input_data, ctx)
                    try:
                        result = await asyncio.wait_for(asyncio.wrap_future(cfut), timeout=self.timeout_s)
                    except TimeoutError:
                        raise PolicyFailed(name, action, *self._overran(cfut, started, rule, action)) from None
            finally:
                if trace is not None:
                    lines = [list(line) for line in getattr(inst, "logs", None) or ()] + printed[:MAX_PRINT_LINES + 1]
                    if lines:
                        trace["logs"] = lines
        except PolicyFailed:
            raise
        except SandboxUnsendable as exc:  # its input never reached its process: the call never ran
            raise PolicyFailed(name, action, str(exc), "wrong_input") from None
        except Exception as exc:
            cause: BaseException = exc.__cause__ if isinstance(exc, _Escaped) and exc.__cause__ else exc
            raise PolicyFailed(name, action, f"raised {type(cause).__name__}: {cause}", "raised")
        try:
            contract.check(action, result)
        except contract.WrongShape as exc:
            raise PolicyFailed(name, action, f"wrong return shape: {exc}", "wrong_shape")
        except Exception as exc:  # e.g. a result whose repr raises
            raise PolicyFailed(name, action, f"unreadable result: {type(exc).__name__}: {exc}", "wrong_shape")
        return result


    async def _loaded(self, rule: dict[str, Any], rule_id: str, name: str, action: str, builtin: bool) -> Any:
        """``invoke``'s policy instance; raises PolicyFailed when it cannot be had."""
        try:
            if builtin:
                inst, _, _ = await self.instance(rule, rule_id)
            else:
                inst, _, _ = await asyncio.wait_for(self.instance(rule, rule_id), timeout=self._load_limit())
        except TimeoutError:
            busy = self._busy() if self.overrunning >= POLICY_THREADS else ""
            # slow Redis, a loaded worker or threads held by other policies' overruns: not this
            # policy's answer, so a step asked again may load it (not ``NO_ANSWER``)
            raise PolicyFailed(name, action, f"loading timed out after {self._load_limit():g}s{busy}", "unavailable")
        except SandboxLoadError as exc:  # the source or its constructor failed in its process
            raise PolicyFailed(name, action, f"cannot load {rule.get('policyRuleURI')!r}: {exc}", "load")
        except RegistryUnavailable as exc:  # a step asked again may find it: not a policy that gave no answer
            raise PolicyFailed(name, action, f"cannot read {rule.get('policyRuleURI')!r} from the registry: {exc}",
                               "unavailable")
        except Exception as exc:
            raise PolicyFailed(name, action, f"cannot load {rule.get('policyRuleURI')!r}: {type(exc).__name__}: {exc}", "load")
        return inst

    async def _sandboxed(self, inst: Any, name: str, action: str, params: JSONObject, input_data: Mapping[str, object],
                         ctx: JSONObject, printed: list[list[str]]) -> Any:
        """One call of a Python policy in its process (``sandbox.python_sandboxed_class``): the
        pool's own limit stops it (a thread here only waits, never longer than the limit)."""
        try:
            status, value, lines = await asyncio.get_running_loop().run_in_executor(
                self._pool, inst.call, params, input_data, ctx, self.timeout_s)
        except SandboxTimeout as exc:
            _log().warning("policy.overran", policy=name, action=action, limit_s=self.timeout_s, note=str(exc))
            raise PolicyFailed(name, action, str(exc), "timed_out") from None
        except SandboxBusy as exc:  # other calls held its process: a step asked again may run it
            raise PolicyFailed(name, action, str(exc), "unavailable") from None
        except SandboxCrash as exc:  # os._exit, a segfault, killed from outside: this call's doing
            raise PolicyFailed(name, action, str(exc), "raised") from None
        printed.extend(lines)
        if status == "ok":
            return pickle.loads(value)
        if status == "load":
            raise PolicyFailed(name, action, f"cannot load its instance: {value}", "load")
        raise PolicyFailed(name, action, f"raised {value}" if status == "raised" else value, status)

    def _overran(self, cfut: concurrent.futures.Future[Any], started: list[bool], rule: dict[str, Any],
                 action: str) -> tuple[str, str]:
        """The reason and ``PolicyFailed.kind`` of a call past its time limit. One that never
        started (every pool thread held by calls that overran theirs) says so, and is
        ``unavailable``: not this policy's fault, a step asked again may run it; one that did is
        ``timed_out`` and keeps its thread until it returns, counted in ``overrunning`` and
        logged, since the worker is slower while it spins."""
        if not started and cfut.cancel():
            return f"timed out after {self.timeout_s:g}s{self._busy()}", "unavailable"
        with self._overrun_lock:
            self.overrunning += 1

        def done(_: concurrent.futures.Future[Any]) -> None:
            with self._overrun_lock:
                self.overrunning -= 1

        cfut.add_done_callback(done)
        _log().warning("policy.overran", uri=rule.get("policyRuleURI"), action=action, limit_s=self.timeout_s,
                       overrunning=self.overrunning,
                       note="a Python policy call cannot be stopped: its thread runs until the call returns")
        return f"timed out after {self.timeout_s:g}s", "timed_out"


    def _load_limit(self) -> float:
        """Loading's time limit: a process-sandboxed source is checked, then its instance built,
        each in a child that may be starting (whose own limit stops a runaway top level)."""
        if self.python_sandbox == "process":
            return 2 * (self.timeout_s + START_ALLOWANCE_S)
        return self.timeout_s

    def _busy(self) -> str:
        return (f" without starting: all {POLICY_THREADS} policy threads are still running calls that overran their "
                f"time limit ({self.overrunning}); fix those policies and restart the worker to free them")


def _log() -> Any:
    import structlog

    return structlog.get_logger("aios.policy")


class RegistryUnavailable(Exception):
    """The policy registry's look-up raised (its store did not answer), as opposed to a policy
    that is not there or does not load."""


class _Escaped(Exception):
    """A BaseException (SystemExit, KeyboardInterrupt) raised by policy code, made an Exception."""


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        raise
    except BaseException as exc:  # never let policy code exit the worker
        raise _Escaped(repr(exc)) from exc
