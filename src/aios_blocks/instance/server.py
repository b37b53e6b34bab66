"""The instance SDK's HTTP server (aiohttp): the task path of the block's input protocol,
``GET /health`` and ``GET /metrics``, on the port the node agent gave the instance.

    from aios_blocks.instance import serve

    def handle(task, ctx):
        return {"echo": task.json()}

    if __name__ == "__main__":
        serve(handle)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from typing import Any

import structlog
from aiohttp import web

from ..schemas.protocol import HEALTH_PATH, METRICS_PATH
from .app import Context, Handler, Init, InstanceApp, Task, runs_in_thread
from .metrics import CONTENT_TYPE

log = structlog.get_logger("aios.instance")

APP_KEY = web.AppKey("instance", InstanceApp)


def web_app(app: InstanceApp, client_max_size: int = 64 * 1024 * 1024) -> web.Application:
    """The aiohttp application of an :class:`InstanceApp` (tests may serve it on any port)."""
    wa = web.Application(client_max_size=client_max_size, middlewares=[_token_check])
    wa[APP_KEY] = app
    wa.router.add_get(HEALTH_PATH, _health)
    wa.router.add_get(METRICS_PATH, _metrics)
    wa.router.add_route(app.ctx.task_method, app.ctx.task_path, _task)
    return wa


#: what anyone may read without the instance's token: the agent's probe and drain, the health
#: checker, the metrics collector and ``builtin:least-queue`` read them, none holding a token
OPEN = {(HEALTH_PATH, "GET"), (METRICS_PATH, "GET")}


@web.middleware
async def _token_check(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every request but ``GET /health`` and ``GET /metrics`` needs the instance's token when it
    has one (``InstanceApp.unauthorized``: 401, unrun, uncounted; the body is not read). One
    meant for another instance is told so first (421), as before: the executor tries another."""
    if (request.path, request.method) not in OPEN and request.app[APP_KEY].ctx.token:
        app = request.app[APP_KEY]
        what = "task" if request.path == app.ctx.task_path else "request"
        refused = app.misdirected(request.headers, what) or app.unauthorized(request.headers, what)
        if refused is not None:
            return web.Response(body=refused.body, status=refused.status, content_type="application/json", headers=refused.headers)
    resp: web.StreamResponse = await handler(request)
    return resp


def _misdirected(request: web.Request) -> web.Response | None:
    """421 for a probe or scrape meant for another instance (the checker's, an executor's)."""
    wrong = request.app[APP_KEY].misdirected(request.headers, "request")
    if wrong is None:
        return None
    return web.Response(body=wrong.body, status=wrong.status, content_type="application/json", headers=wrong.headers)


async def _health(request: web.Request) -> web.Response:
    if (wrong := _misdirected(request)) is not None:
        return wrong
    status, body = request.app[APP_KEY].health()
    return web.json_response(body, status=status)


async def _metrics(request: web.Request) -> web.Response:
    if (wrong := _misdirected(request)) is not None:
        return wrong
    return web.Response(body=request.app[APP_KEY].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def _task(request: web.Request) -> web.StreamResponse:
    app = request.app[APP_KEY]
    task = Task(await request.read(), request.headers, request.path, request.query)
    reply = await app.call(task)
    headers = dict(reply.headers)
    if reply.content_type:
        headers["Content-Type"] = reply.content_type
    if not reply.stream:
        return web.Response(body=reply.body, status=reply.status, headers=headers)
    resp = web.StreamResponse(status=reply.status, headers=headers)
    resp.enable_chunked_encoding()
    stream = reply.body
    try:
        await resp.prepare(request)
        async for chunk in stream:
            await resp.write(chunk)
        await resp.write_eof()
    except Exception as exc:  # the handler broke mid-stream: the client sees a cut answer
        log.warning("instance.stream_failed", error=repr(exc))
    finally:
        await stream.aclose()
    return resp


async def run(app: InstanceApp, stop: asyncio.Event, host: str | None = None, port: int | None = None,
              shutdown_timeout_s: float = 10.0) -> None:
    """Serve until ``stop``: listening at once (``/health`` answers 503 while the init runs),
    ready when the init is done; an init that fails ends the server (the exception is raised)."""
    runner = web.AppRunner(web_app(app), handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host or app.ctx.host, port if port is not None else app.ctx.port, reuse_address=True)
    await site.start()
    log.info("instance.listening", host=host or app.ctx.host, port=port or app.ctx.port, path=app.ctx.task_path)
    try:
        await app.start()
        log.info("instance.ready", instance=app.ctx.instance_id)
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(handler: Handler, init: Init | None = None, *, max_concurrency: int | None = None, host: str | None = None,
          port: int | None = None, env: Mapping[str, str] | None = None) -> None:
    """Run an instance: ``handler(task, ctx)`` answers tasks, ``init(ctx)`` (optional) loads what it
    needs first. Port, host, ids and settings come from the node agent's environment (``env``,
    default this process's; see ``Context.from_env``). ``max_concurrency``: tasks handled at once
    (default: 1 for a plain ``def`` handler, which runs in a thread; unlimited for ``async def``).
    SIGTERM / SIGINT stop it gracefully (in-flight tasks get up to 10 s). Exits 1 if the init fails."""
    ctx = Context.from_env(os.environ if env is None else env)
    if max_concurrency is None:
        max_concurrency = int(ctx.settings.get("maxConcurrency", 1 if runs_in_thread(handler) else 0) or 0)
    app = InstanceApp(handler, init, ctx, max_concurrency)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await run(app, stop, host, port)

    try:
        try:
            import uvloop  # the faster event loop when installed (a dependency off Windows)

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
    except Exception as exc:
        log.error("instance.failed", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
