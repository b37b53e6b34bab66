"""The instance SDK's core, with no server: an :class:`InstanceApp` runs a task handler with the
system metrics, the readiness of its init and an optional concurrency limit, so a handler (and
everything the server does with it) is unit-testable by calling :meth:`InstanceApp.call`.

A handler takes ``(task, ctx)`` and returns:

* a JSON-able value (dict, list, number...) -> ``200 application/json``;
* ``str`` -> ``text/plain``; ``bytes`` -> ``application/octet-stream``;
* a :class:`Reply` -> its status, body, content type and headers;
* an async iterator of chunks (``bytes``, ``str``, or JSON-able values sent one per line as
  NDJSON) -> a chunked, streamed answer;
* or raises :class:`TaskError` (its status and message) or anything else (500).

An ``async def`` handler runs on the event loop; a plain ``def`` handler (a CPU-bound model) runs
in a worker thread, so ``/health`` and ``/metrics`` keep answering while it computes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import structlog

from ..schemas.protocol import (
    INSTANCE_HEADER,
    INSTANCE_TOKEN_ENV,
    INSTANCE_TOKEN_HEADER,
    MISDIRECTED,
    UNAUTHORIZED,
    misdirected,
    task_method,
    task_path,
    unauthorized,
)
from ..schemas.records import JSONObject
from .metrics import Metrics

log = structlog.get_logger("aios.instance")

Handler = Callable[["Task", "Context"], Any]
Init = Callable[["Context"], Any]


def _json_obj(raw: str | None) -> JSONObject:
    try:
        d = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


class HealthDoc(TypedDict, total=False):
    """An instance's ``/health`` answer: starting, ready (with its id) or failed (with why)."""

    status: str
    error: str
    instance_id: str


@dataclass
class Context:
    """What an instance knows of itself (from the environment the node agent gives it; see
    ``Context.from_env``) and its metrics."""

    instance_id: str = ""
    block_id: str = ""
    #: the seed's ``blockInitData``, ``initSettings`` and ``parameters`` (block values over the component's)
    init_data: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    input_protocol: JSONObject = field(default_factory=dict)
    port: int = 8000
    host: str = "127.0.0.1"
    workdir: Path | None = None
    metrics: Metrics = field(default_factory=Metrics)
    #: whatever the init wants to keep (a loaded model...)
    state: dict[str, Any] = field(default_factory=dict)
    #: the token a task must carry (``Aios-Instance-Token``, from ``AIOS_INSTANCE_TOKEN``, which
    #: the node agent sets when it has its node's instance key); "" takes any caller's task
    token: str = field(default="", repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Context:
        """From the node agent's variables: ``AIOS_INSTANCE_ID``, ``AIOS_BLOCK_ID``,
        ``AIOS_PORT_HTTP`` / ``AIOS_PORT``, ``AIOS_HOST``, ``AIOS_WORKDIR``, ``AIOS_INSTANCE_TOKEN``,
        and the JSON of ``blockInitData``, ``initSettings``, ``parameters``, ``inputProtocol``."""
        port = env.get("AIOS_PORT_HTTP") or env.get("AIOS_PORT") or "8000"
        workdir = env.get("AIOS_WORKDIR")
        return cls(
            instance_id=env.get("AIOS_INSTANCE_ID", ""), block_id=env.get("AIOS_BLOCK_ID", ""),
            init_data=_json_obj(env.get("blockInitData")), settings=_json_obj(env.get("initSettings")),
            parameters=_json_obj(env.get("parameters")), input_protocol=_json_obj(env.get("inputProtocol")),
            port=int(port), host=env.get("AIOS_HOST") or "127.0.0.1", workdir=Path(workdir) if workdir else None,
            token=env.get(INSTANCE_TOKEN_ENV, "").strip(),
        )

    @property
    def task_path(self) -> str:
        return task_path(self.input_protocol)

    @property
    def task_method(self) -> str:
        return task_method(self.input_protocol)


@dataclass
class Task:
    """One task as the handler sees it: the request body and headers (not the HTTP objects)."""

    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    path: str = "/infer"
    query: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON (``TaskError`` 400 when it is not)."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError as exc:
            raise TaskError(400, f"the task is not JSON: {exc}") from None

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class TaskError(Exception):
    """A task the handler refuses or cannot do: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Reply:
    """A handler's answer, or what :meth:`InstanceApp.call` gives back: ``body`` is ``bytes`` or,
    for a streamed answer, an async iterator of ``bytes`` (``stream`` is then True)."""

    body: Any = b""
    status: int = 200
    content_type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return hasattr(self.body, "__aiter__")

    def json(self) -> Any:
        assert isinstance(self.body, bytes | bytearray), "a streamed reply: iterate over .body"
        return json.loads(self.body)


def _chunk(c: Any) -> bytes:
    if isinstance(c, bytes | bytearray):
        return bytes(c)
    if isinstance(c, str):
        return c.encode()
    return json.dumps(c).encode() + b"\n"


def _encode(value: Any) -> Reply:
    if isinstance(value, Reply):
        inner = value.body
        if hasattr(inner, "__aiter__"):
            return Reply(inner, value.status, value.content_type or "application/x-ndjson", dict(value.headers))
        base = _encode(inner)
        return Reply(base.body, value.status, value.content_type or base.content_type, dict(value.headers))
    if hasattr(value, "__aiter__"):
        return Reply(value, 200, "application/x-ndjson")
    if isinstance(value, bytes | bytearray):
        return Reply(bytes(value), 200, "application/octet-stream")
    if isinstance(value, str):
        return Reply(value.encode(), 200, "text/plain; charset=utf-8")
    return Reply(json.dumps(value).encode(), 200, "application/json")


def _error(status: int, message: str) -> Reply:
    return Reply(json.dumps({"error": message}).encode(), status, "application/json")


def runs_in_thread(handler: Handler) -> bool:
    """A plain ``def`` handler runs in a worker thread; ``async def`` ones on the event loop."""
    return not (inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler))


class InstanceApp:
    """A handler with its init, metrics and concurrency limit (``max_concurrency`` tasks at once,
    the rest wait in order and count as ``requests_waiting``; 0 = no limit)."""

    def __init__(self, handler: Handler, init: Init | None = None, context: Context | None = None, max_concurrency: int = 0):
        self.handler = handler
        self.init = init
        self.ctx = context or Context()
        self.metrics = self.ctx.metrics
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
        self._sync = runs_in_thread(handler)
        self.init_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.metrics.system.ready

    async def start(self) -> None:
        """Run the init (a plain function in a thread); ready after it, ``init_error`` if it raised."""
        try:
            if self.init is not None:
                if inspect.iscoroutinefunction(self.init):
                    await self.init(self.ctx)
                else:
                    out = await asyncio.to_thread(self.init, self.ctx)
                    if inspect.isawaitable(out):
                        await out
        except Exception as exc:
            self.init_error = f"{type(exc).__name__}: {exc}"
            raise
        self.metrics.system.ready = True

    def health(self) -> tuple[int, HealthDoc]:
        if self.init_error:
            return 503, {"status": "failed", "error": self.init_error}
        if not self.ready:
            return 503, {"status": "starting"}
        return 200, {"status": "ready", "instance_id": self.ctx.instance_id}

    def misdirected(self, headers: Mapping[str, str], what: str = "task") -> Reply | None:
        """``421 Misdirected Request`` for a task meant for another instance (its ``Aios-Instance``
        header, which the executor sets, names another id than this instance's
        ``AIOS_INSTANCE_ID``): the endpoint's port now serves this instance while the executor's
        map still names the one that left. None: the task is this instance's (or carries no
        header, or this instance has no id). Nothing is run or counted."""
        why = misdirected(self.ctx.instance_id, headers.get(INSTANCE_HEADER), what)
        if not why:
            return None
        reply = _error(MISDIRECTED, why)
        reply.headers[INSTANCE_HEADER] = self.ctx.instance_id
        return reply

    def unauthorized(self, headers: Mapping[str, str], what: str = "task") -> Reply | None:
        """``401`` for a request without this instance's token (``Aios-Instance-Token``, which the
        executors add; compared in constant time) when it has one (``AIOS_INSTANCE_TOKEN``). None:
        let in (the right token, or an instance started without one). Nothing is run or counted.
        The server asks it of every request but ``GET /health`` and ``GET /metrics``."""
        why = unauthorized(self.ctx.token, headers.get(INSTANCE_TOKEN_HEADER), what)
        if not why:
            return None
        reply = _error(UNAUTHORIZED, why)
        reply.headers["WWW-Authenticate"] = INSTANCE_TOKEN_HEADER
        return reply

    async def call(self, task: Task | bytes | Any) -> Reply:
        """Handle one task as the server does (readiness, limit, metrics, errors). ``task``: a
        :class:`Task`, raw bytes, or a JSON-able value. A streamed reply's ``body`` is an async
        iterator of bytes; the task counts as running until it is drained or closed. A task meant
        for another instance (``Aios-Instance``) is answered 421 unrun (:meth:`misdirected`)."""
        if isinstance(task, bytes):
            task = Task(task, path=self.ctx.task_path)
        elif not isinstance(task, Task):
            task = Task(json.dumps(task).encode(), {"Content-Type": "application/json"}, self.ctx.task_path)
        elif task.headers:
            wrong = self.misdirected(task.headers)
            if wrong is not None:
                return wrong
        if not self.ready:
            why = f"init failed: {self.init_error}" if self.init_error else "not ready: the instance is still starting"
            return _error(503, why)
        m = self.metrics.system
        started = time.perf_counter()
        if self._slots is not None:
            m.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                m.waiting -= 1
        m.running += 1
        try:
            reply = await self._run(task)
        except BaseException:  # cancelled (the client went away)
            self._finish(started, True)
            raise
        if reply.stream:
            reply.body = _Stream(reply.body, lambda error: self._finish(started, error))
        else:
            self._finish(started, reply.status >= 500)
        return reply

    async def _run(self, task: Task) -> Reply:
        try:
            if self._sync:
                out = await asyncio.to_thread(self.handler, task, self.ctx)
            else:
                out = self.handler(task, self.ctx)
            if inspect.isawaitable(out):
                out = await out
            return _encode(out)
        except TaskError as exc:
            return _error(exc.status, exc.message)
        except Exception as exc:
            log.warning("instance.task_failed", error=repr(exc))
            return _error(500, f"{type(exc).__name__}: {exc}")

    def _finish(self, started: float, error: bool) -> None:
        m = self.metrics.system
        m.running -= 1
        if self._slots is not None:
            self._slots.release()
        m.observe(time.perf_counter() - started, error)


class _Stream:
    """A streamed answer's chunks as bytes; calls ``done(error)`` exactly once: drained (no
    error), failed mid-way or closed early (error)."""

    def __init__(self, chunks: Any, done: Callable[[bool], None]):
        self._it = chunks.__aiter__()
        self._done: Callable[[bool], None] | None = done

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return _chunk(await self._it.__anext__())
        except StopAsyncIteration:
            self._end(False)
            raise
        except BaseException:
            self._end(True)
            raise

    def _end(self, error: bool) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(error)

    async def aclose(self) -> None:
        """Stop early (the client went away): the handler's generator is closed too."""
        close: Callable[[], Awaitable[None]] | None = getattr(self._it, "aclose", None)
        self._end(True)
        if close is not None:
            await close()


__all__ = ["Context", "Handler", "Init", "InstanceApp", "Reply", "Task", "TaskError"]
