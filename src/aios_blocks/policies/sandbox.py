"""Run Starlark policies in child processes with an address-space limit.

starlark-pyo3 has a time limit (polled) but no heap limit, and starlark-rust aborts the process
when an allocation fails, so a tenant's ``list(range(10**9))`` would kill a worker. Here each call
runs in a spawned child process with ``RLIMIT_AS`` set: a scriptlet that allocates past the limit
kills only that child; the call fails with a clear reason and the pool is replaced.

The child compiles each (name, source) once and keeps instances per (rule, settings, parameters),
so the cost per call is the round trip of the payload (pickled), not a compile.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import threading
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ..schemas.records import JSONObject
from ..settings import load as load_settings


class SandboxCrash(RuntimeError):
    """The child process running the scriptlet died (memory limit, abort) or overran."""


# -- child side ---------------------------------------------------------------------------------
_classes: dict[str, type] = {}
_instances: dict[tuple[str, str, str], Any] = {}


def _limit(memory_mb: int) -> None:
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


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


# -- parent side --------------------------------------------------------------------------------
class SandboxPool:
    def __init__(self, workers: int | None = None, memory_mb: int | None = None):
        """``workers``, ``memory_mb``: AIOS_STARLARK_PROCESSES, AIOS_STARLARK_MEMORY_MB unless given."""
        s = load_settings()
        self.workers = s.starlark_processes if workers is None else workers
        self.memory_mb = s.starlark_memory_mb if memory_mb is None else memory_mb
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _get(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_limit,
                    initargs=(self.memory_mb,),
                )
            return self._pool

    def _replace(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        for proc in list(getattr(pool, "_processes", {}).values()):
            if proc.is_alive():
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def call(self, source: str, name: str, rule_id: str, settings: JSONObject, parameters: JSONObject,
             input_data: Mapping[str, object], context: JSONObject, timeout_s: float) -> tuple[Any, JSONObject, list[list[str]]]:
        key = f"{name}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"
        pool = self._get()
        fut = pool.submit(_call, key, source, name, rule_id, settings, parameters, input_data, dict(context))
        try:
            return fut.result(timeout=timeout_s)
        except BrokenProcessPool:
            self._replace(pool)
            raise SandboxCrash(
                f"the scriptlet's process died (memory limit {self.memory_mb} MiB exceeded, or it aborted)"
            ) from None
        except concurrent.futures.TimeoutError:
            self._replace(pool)
            raise SandboxCrash(f"the scriptlet's process did not answer within {timeout_s:g}s and was killed") from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


_shared: SandboxPool | None = None


def shared() -> SandboxPool:
    global _shared
    if _shared is None:
        _shared = SandboxPool()
    return _shared


def sandboxed_class(source: str, name: str, timeout_s: float, pool: Callable[[], SandboxPool] = shared) -> type:
    """A seed-shaped class whose ``eval`` runs the scriptlet in the sandbox pool."""

    class SandboxedStarlarkPolicy:
        def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
            self.rule_id = str(rule_id)
            self.settings = settings or {}
            self.parameters = parameters or {}
            self.logs: list[list[str]] = []

        def eval(self, parameters: JSONObject, input_data: Mapping[str, object], context: JSONObject | None) -> Any:
            result, ctx_after, self.logs = pool().call(
                source, name, self.rule_id, self.settings, self.parameters, input_data, dict(context or {}), timeout_s
            )
            if context is not None:
                for k in [k for k in context if k not in ctx_after]:
                    del context[k]
                context.update(ctx_after)
            return result

    SandboxedStarlarkPolicy.__name__ = f"Starlark[{name}]"
    return SandboxedStarlarkPolicy
