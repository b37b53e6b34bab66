"""Resource lifecycle of one instance, after seed 001 (Backend.AI agent architecture).

* :class:`Provisioner` sets one kind of resource up and tears it down: a matched pair.
* :class:`Stage` waits for its spec (possibly derived from other stages' resources), sets the
  resource up through its provisioner and exposes the resource, or the failure.
* :class:`Runner` owns the stages of one instance: sets them up in order; if one fails, tears down
  every stage already set up (reverse order) and reports which stage failed and why; when the
  instance ends (``close``), tears them all down in reverse order. ``cancel`` (agent shutdown)
  stops the runner *without* reclaiming anything: the instance keeps running and the next agent
  finds it again by its labels.

No state lives anywhere but in the resources themselves (container labels, process environment,
directories): nothing is pickled.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import structlog
from prometheus_client import Counter, Histogram

log = structlog.get_logger("aios.agent.lifecycle")

TSpec = TypeVar("TSpec")
TResource = TypeVar("TResource")

SETUP_SECONDS = Histogram("aios_agent_stage_setup_seconds", "Stage setup time", ["stage"])
TEARDOWN_SECONDS = Histogram("aios_agent_stage_teardown_seconds", "Stage teardown time", ["stage"])
STAGE_FAILURES = Counter("aios_agent_stage_failures_total", "Stage setups that failed", ["stage"])
#: stage name -> its setup / teardown histogram (``labels`` takes a lock and checks its values at
#: every call: a few microseconds, three times per instance start)
_SETUP: dict[str, Histogram] = {}
_TEARDOWN: dict[str, Histogram] = {}


def _timer(metric: Histogram, by_stage: dict[str, Histogram], stage: str) -> Histogram:
    child = by_stage.get(stage)
    if child is None:
        child = by_stage[stage] = metric.labels(stage)
    return child


class Provisioner(ABC, Generic[TSpec, TResource]):
    """Sets up and tears down one kind of resource (seed 001)."""

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    async def setup(self, spec: TSpec) -> TResource: ...

    @abstractmethod
    async def teardown(self, resource: TResource) -> None: ...


class SpecGenerator(ABC, Generic[TSpec]):
    @abstractmethod
    async def wait_for_spec(self) -> TSpec: ...


class FixedSpec(SpecGenerator[TSpec]):
    """A spec known up front."""

    def __init__(self, spec: TSpec):
        self._spec = spec

    async def wait_for_spec(self) -> TSpec:
        return self._spec


class DerivedSpec(SpecGenerator[TSpec]):
    """A spec built from other stages' resources: waits for them, then calls ``build``. The
    dependency is explicit (injected), not read from a shared context."""

    def __init__(self, build: Callable[..., TSpec], *deps: Stage[Any, Any]):
        self._build = build
        self._deps = deps

    async def wait_for_spec(self) -> TSpec:
        resources = [await d.wait_for_resource() for d in self._deps]
        return self._build(*resources)


class StageFailed(Exception):
    def __init__(self, stage: str, cause: BaseException | str):
        self.stage = stage
        self.cause = cause
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"stage {stage!r} failed: {text}")


class Stage(ABC, Generic[TSpec, TResource]):
    name: str

    @abstractmethod
    async def setup(self, spec_generator: SpecGenerator[TSpec]) -> None: ...

    @abstractmethod
    async def wait_for_resource(self) -> TResource: ...

    @abstractmethod
    async def teardown(self) -> None: ...

    @property
    @abstractmethod
    def is_set_up(self) -> bool: ...


class ProvisionStage(Stage[TSpec, TResource]):
    """A stage that provisions its resource with a provisioner (seed 001's example, plus: the
    failure itself is kept and exposed, and setup/teardown are timed per stage)."""

    def __init__(self, provisioner: Provisioner[TSpec, TResource]):
        self._provisioner = provisioner
        self.name = provisioner.name
        self._resource: TResource | None = None
        self._error: BaseException | None = None
        self._done = asyncio.Event()

    @classmethod
    def adopted(cls, provisioner: Provisioner[TSpec, TResource], resource: TResource) -> ProvisionStage[TSpec, TResource]:
        """A stage around a resource that already exists (re-adoption after an agent restart)."""
        stage = cls(provisioner)
        stage._resource = resource
        stage._done.set()
        return stage

    async def setup(self, spec_generator: SpecGenerator[TSpec]) -> None:
        started = time.perf_counter()
        try:
            spec = await spec_generator.wait_for_spec()
            self._resource = await self._provisioner.setup(spec)
        except asyncio.CancelledError:
            self._error = StageFailed(self.name, "cancelled")
            raise
        except BaseException as exc:  # kept and exposed by wait_for_resource
            self._error = exc
            STAGE_FAILURES.labels(self.name).inc()
            log.warning("stage.setup_failed", stage=self.name, error=repr(exc))
        finally:
            _timer(SETUP_SECONDS, _SETUP, self.name).observe(time.perf_counter() - started)
            self._done.set()

    async def wait_for_resource(self) -> TResource:
        await self._done.wait()
        if self._error is not None:
            raise StageFailed(self.name, self._error)
        if self._resource is None:
            raise StageFailed(self.name, "no resource")
        return self._resource

    @property
    def is_set_up(self) -> bool:
        return self._resource is not None

    @property
    def resource(self) -> TResource | None:
        return self._resource

    async def teardown(self) -> None:
        if self._resource is None:
            return
        started = time.perf_counter()
        try:
            await self._provisioner.teardown(self._resource)
        finally:
            _timer(TEARDOWN_SECONDS, _TEARDOWN, self.name).observe(time.perf_counter() - started)
        self._resource = None


class Runner:
    """Owns the stages of one instance (seed 001 ``Runner``)."""

    def __init__(self, instance_id: str, stages: Sequence[tuple[Stage[Any, Any], SpecGenerator[Any]]]):
        self.instance_id = instance_id
        self._stages = list(stages)
        #: set up (or adopted) and owning its resources: ``close`` tears them down
        self._running = False
        #: ``cancel`` (agent shutdown): ``close`` then reclaims nothing
        self._cancelled = False
        #: the teardown ``close`` started: a second ``close`` waits for it rather than tearing down again
        self._closing: asyncio.Future[None] | None = None
        self.teardown_errors: list[str] = []

    @classmethod
    def adopted(cls, instance_id: str, stages: Sequence[Stage[Any, Any]]) -> Runner:
        """A runner around stages whose resources already exist: started without setting up."""
        runner = cls(instance_id, [(s, FixedSpec(None)) for s in stages])
        runner._running = True
        return runner

    def stage(self, name: str) -> Stage[Any, Any]:
        for s, _ in self._stages:
            if s.name == name:
                return s
        raise KeyError(name)

    async def start(self) -> None:
        """Set every stage up in order; on failure tear down what was set up and raise StageFailed.
        No task waits for the end: ``close`` tears down itself (nothing runs on the event loop
        between the setup and the end but the instance's own resources)."""
        if self._closing is not None or self._cancelled:
            raise RuntimeError("runner is already closed")
        try:
            for stage, spec in self._stages:
                await stage.setup(spec)
                await stage.wait_for_resource()
        except BaseException:
            await self._cleanup()
            raise
        self._running = True

    async def _cleanup(self) -> None:
        for stage, _ in reversed(self._stages):
            if not stage.is_set_up:
                continue
            try:
                await stage.teardown()
            except Exception as exc:  # keep tearing down the others; report what stayed behind
                self.teardown_errors.append(f"{stage.name}: {type(exc).__name__}: {exc}")
                log.error("stage.teardown_failed", stage=stage.name, instance=self.instance_id, error=repr(exc))

    async def close(self) -> None:
        """End the instance: tear every stage down (reverse order) and wait until it is done; once
        (a second call waits for the first's teardown). After ``cancel``: nothing is reclaimed."""
        if self._cancelled:
            return
        if not self._running:  # never set up (or its setup failed and cleaned up): what is set up goes
            await self._cleanup()
            return
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_future()
            try:
                await self._cleanup()
            finally:
                self._closing.set_result(None)
        else:
            await asyncio.shield(self._closing)

    def cancel(self) -> None:
        """Agent shutdown: stop owning the instance without reclaiming its resources."""
        if self._running and self._closing is None:
            self._cancelled = True


async def with_timeout(what: str, coro: Awaitable[TResource], seconds: float) -> TResource:
    try:
        async with asyncio.timeout(seconds):  # in this task: no task per call, as wait_for makes
            return await coro
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish within {seconds:g}s") from None
