"""Ingress: how tasks reach the executor, each turned into one :meth:`Dispatcher.dispatch`.

* **NATS**: ``aios.block.{bid}.task`` requests, as the queue group ``executor``; the reply is the
  instance's answer (``Aios-Status`` = its HTTP status, ``Aios-Instance``) or the executor's own
  error (``Aios-Status`` 404/429/500/502/503/504, ``Aios-Error``, ``Retry-After-Ms``).
* **HTTP** (``AIOS_EXECUTOR_HTTP_PORT``; copies share the port with SO_REUSEPORT):
  ``POST /blocks/{bid}/tasks`` goes to the component's input protocol path,
  ``/blocks/{bid}/{path}`` to ``/{path}`` of the instance, any method; responses are streamed.

With a users file (``AIOS_EXECUTOR_HTTP_USERS``; ``blocks up`` names its own when auth is on) the
HTTP paths under ``/blocks/`` need HTTP Basic credentials of a user who may send that block a task
over NATS (``executor.task_auth``); ``/health`` stays open.

Every answer carries its task id (``Aios-Task-Id``: the caller's, else a fresh one); the outputs of
blocks that publish them are offered to the output publisher after the answer."""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp
import msgspec
from aiohttp import web

from ..runtime.httperrors import json_errors
from ..schemas.records import RouteView
from ..schemas.spec import ID_RE
from .dispatch import HOP_HEADERS, Dispatcher, header_problems
from .engine import Refused, Route
from .outputs import OutputPublisher, task_id_of
from .task_auth import CHALLENGE, TaskUsers, authenticate, authorize

#: an HTTP answer of known length up to this size is passed on in one write (others are streamed)
SMALL_BODY = 256 * 1024


def clean(text: str) -> str:
    """A header value: one line, bounded."""
    return " ".join(text.split())[:1000]


#: the request headers the executor reads, by their lower-case names (HTTP header names are
#: case-insensitive: ``AIOS-TIMEOUT-MS`` is ``Aios-Timeout-Ms``)
OWN_HEADERS = {h.lower(): h for h in ("Aios-Task-Id", "Aios-Timeout-Ms", "Aios-Idempotent")}


def canonical(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A request's headers with the executor's own under their canonical names, whatever case the
    caller wrote them in (``AIOS-TIMEOUT-MS: abc`` was forwarded to the instance unread, and
    ``AIOS-IDEMPOTENT: true`` taken as no); the others as given."""
    return {OWN_HEADERS.get(k.lower(), k): v for k, v in headers}


def refused_headers(headers: dict[str, str], bid: str = "") -> tuple[str, Refused | None]:
    """(task id, the refusal of a task whose block id (``bid``, when given) or ``Aios-*`` request
    headers are wrong, every problem named, or ``None``): checked before the task goes anywhere. A
    block id that is no id (``/blocks/a%20b/tasks``, ``aios.block.*.task``) was "unknown block"
    (404), as if such a block could exist."""
    task_id, problem = task_id_of(headers)
    problems = [] if not bid or ID_RE.match(bid) else [
        f"block id {bid[:130]!r} is not a valid id: letters, digits, '-' and '_', at most 128, starting with a "
        "letter or digit"]
    problems += ([problem] if problem else []) + header_problems(headers)
    return task_id, Refused(400, "; ".join(problems)) if problems else None


def refusal_headers(r: Refused) -> dict[str, str]:
    h = {"Aios-Status": str(r.status), "Aios-Error": clean(r.reason)}
    if r.retry_after_ms is not None:
        h["Retry-After-Ms"] = str(r.retry_after_ms)
    return h


def refusal_body(r: Refused) -> bytes:
    return msgspec.json.encode({"error": r.reason, "status": r.status, "retry_after_ms": r.retry_after_ms})


class Ingress:
    """The NATS responder and the HTTP app of one executor. ``outputs_on``: the blocks whose task
    outputs are published (the executor keeps it from their maps)."""

    def __init__(self, dispatcher: Dispatcher, outputs: OutputPublisher, outputs_on: set[str], max_output_bytes: int,
                 users: TaskUsers | None = None):
        self.d = dispatcher
        #: who may send tasks over HTTP (None: anyone who reaches the port, as without auth)
        self.users = users
        self.outputs = outputs
        self.outputs_on = outputs_on
        self.max_output_bytes = max_output_bytes

    def _gen(self, bid: str) -> int:
        route = self.d.routes.get(bid)
        return route.gen if route is not None else 0

    # -- NATS -------------------------------------------------------------------------------------
    async def on_task(self, tokens: dict[str, str], body: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        bid = tokens.get("bid", "")
        headers = canonical(headers.items())
        task_id, refused = refused_headers(headers, bid)
        if refused is not None:
            return refusal_body(refused), {**refusal_headers(refused), **({"Aios-Task-Id": task_id} if task_id else {})}

        async def read_all(resp: aiohttp.ClientResponse, v: RouteView) -> tuple[bytes, dict[str, str]]:
            data = await resp.read()
            h = {"Aios-Status": str(resp.status), "Aios-Instance": v["id"], "Aios-Task-Id": task_id}
            ct = resp.headers.get("Content-Type")
            if ct:
                h["Content-Type"] = ct
            if bid in self.outputs_on:  # queued, not published: the reply goes first
                self.outputs.offer(bid, task_id, v["id"], resp.status, data, ct or "", gen=self._gen(bid))
            return data, h

        try:
            route = self.d.routes.get(bid)
            return await self.d.dispatch(bid, route.method if route else "POST", None, body, headers, read_all)
        except Refused as r:
            return refusal_body(r), {**refusal_headers(r), "Aios-Task-Id": task_id}

    # -- HTTP -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # an unknown path or a wrong method: JSON like every refusal (runtime.httperrors)
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[json_errors(retry_after_ms=None)])
        app.router.add_post("/blocks/{bid}/tasks", self._http_task)
        app.router.add_route("*", "/blocks/{bid}/{tail:.*}", self._http_pass)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "blocks": len(self.d.routes)})

    async def _http_task(self, request: web.Request) -> web.StreamResponse:
        return await self._http(request, None)  # to the input protocol's path (and method)

    async def _http_pass(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        if request.query_string:
            path += "?" + request.query_string
        return await self._http(request, path)

    async def _refused_caller(self, request: web.Request, bid: str) -> web.Response | None:
        """401 without the credentials of a task user, 403 for a tenant's user and another's block
        (or none): before the request's body or headers are read."""
        if self.users is None:
            return None
        who = authenticate(self.users.users(), request.headers.get("Authorization"))
        refused = who if isinstance(who, Refused) else None
        if not isinstance(who, Refused) and who.tenant is not None:
            try:
                route: Route | None = await self.d.route(bid) if ID_RE.match(bid) else None
            except Refused:
                route = None
            refused = authorize(who, bid, route.tenant if route is not None else None)
        if refused is None:
            return None
        return web.Response(status=refused.status, body=refusal_body(refused), content_type="application/json",
                            headers={"Aios-Error": clean(refused.reason), **(CHALLENGE if refused.status == 401 else {})})

    async def _http(self, request: web.Request, path: str | None) -> web.StreamResponse:
        bid = request.match_info["bid"]
        denied = await self._refused_caller(request, bid)
        if denied is not None:
            return denied
        body = await request.read()
        headers = canonical(request.headers.items())
        if self.users is not None:  # the caller's password is the executor's, never the instance's
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        task_id, refused = refused_headers(headers, bid)
        if refused is not None:
            return web.Response(status=400, body=refusal_body(refused), content_type="application/json",
                                headers={"Aios-Error": clean(refused.reason), **({"Aios-Task-Id": task_id} if task_id else {})})
        publish = bid in self.outputs_on and path is None  # outputs of tasks, not of pass-through calls

        async def stream(resp: aiohttp.ClientResponse, v: RouteView) -> web.StreamResponse:
            return await self._stream(request, resp, v, bid, task_id, publish)

        try:
            route = self.d.routes.get(bid)
            method = route.method if path is None and route is not None else request.method
            return await self.d.dispatch(bid, method, path, body, headers, stream)
        except Refused as r:
            h = {"Aios-Error": clean(r.reason), "Aios-Task-Id": task_id}
            if r.retry_after_ms is not None:
                h["Retry-After-Ms"] = str(r.retry_after_ms)
                h["Retry-After"] = str(max(1, -(-r.retry_after_ms // 1000)))
            return web.Response(status=r.status, body=refusal_body(r), headers=h, content_type="application/json")

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse, v: RouteView, bid: str, task_id: str,
                      publish: bool) -> web.StreamResponse:
        """The instance's answer passed on: a small one of known size in one write, else chunk by
        chunk as it comes (the output keeps at most its limit)."""
        headers = {k: val for k, val in resp.headers.items()
                   if k.lower() not in HOP_HEADERS and k.lower() not in ("content-encoding", "date", "server")}
        headers["Aios-Instance"] = v["id"]
        headers["Aios-Task-Id"] = task_id
        ct = resp.headers.get("Content-Type", "")
        n = resp.content_length
        if n is not None and n <= SMALL_BODY:
            data = await resp.read()
            if publish:
                self.outputs.offer(bid, task_id, v["id"], resp.status, data, ct, gen=self._gen(bid))
            return web.Response(status=resp.status, reason=resp.reason, body=data, headers=headers)
        out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=headers)
        if n is not None:
            out.content_length = n
        await out.prepare(request)
        kept, size, limit = bytearray(), 0, self.max_output_bytes + 4
        async for chunk in resp.content.iter_any():  # streamed: each chunk as it comes
            await out.write(chunk)
            if publish:
                size += len(chunk)
                if len(kept) < limit:
                    kept += chunk[: limit - len(kept)]
        await out.write_eof()
        if publish:
            self.outputs.offer(bid, task_id, v["id"], resp.status, bytes(kept), ct, size=size, gen=self._gen(bid))
        return out
