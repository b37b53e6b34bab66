"""JSON errors for the HTTP servers users and their tools call: the executor's task ingress
(``POST /blocks/{bid}/tasks``), the metrics collector's discovery (``/sd/*``, ``/blocks``,
``/health``) and the web console's API (``/api/*``). aiohttp answers an unknown path, a wrong
method or a handler's ``raise web.HTTPBadRequest(text=...)`` in plain text (``405: Method Not
Allowed``); behind this middleware every such answer is a JSON object with the same status:
``{"error": <what was wrong>, "status": <code>}`` (and the server's own fields, e.g. the executor's
``retry_after_ms``), its headers (``Allow`` of a 405) kept. Answers a handler builds itself (the
instances' passed through, JSON refusals) are left as they are."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

#: headers of the plain-text answer that the JSON one replaces
_BODY_HEADERS = frozenset({"content-type", "content-length"})


def error_message(request: web.Request, exc: web.HTTPException) -> str:
    """What was wrong: the handler's own text, else a sentence naming the method and the path."""
    text = exc.text or ""
    if text and text != f"{exc.status}: {exc.reason}":
        return text
    if exc.status == 404:
        return f"no such endpoint: {request.method} {request.path}"
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return f"method {request.method} not allowed on {request.path}" + (f"; allowed: {allowed}" if allowed else "")
    return f"{exc.reason} ({request.method} {request.path})"


def json_errors(**extra: Any) -> Middleware:
    """The middleware: every ``HTTPException`` of 400 or more answered as JSON (``extra``: fields
    added to each body, as ``retry_after_ms=None``)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
            body = {"error": error_message(request, exc), "status": exc.status, **extra}
            return web.json_response(body, status=exc.status, headers=headers)

    return middleware
