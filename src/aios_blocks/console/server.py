"""The console's HTTP server (aiohttp, a dependency already): the page and its vendored assets,
the views' JSON (each takes ``?seq=N``: the stream folded up to N), server-sent events of new
events, and the admin actions (scale, delete).

Access: reads need nothing (the server itself reads the stream with observer rights); an action
needs the admin token in the ``X-Console-Token`` header (a header a cross-site form cannot set),
a JSON body, and an ``Origin`` equal to the page's own (same-origin only). Every response carries
a content security policy that allows only this server's own scripts and styles, and the page
writes all user text as text (``textContent``), never as markup."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from ..runtime.httperrors import json_errors
from . import projection
from .feed import Feed, subject_matches

STATIC = Path(__file__).resolve().parent / "static"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

#: the admin connection's opener (None: the server has no admin credentials; actions answer 503)
AdminOpener = Callable[[], Awaitable[Any]]

FEED: web.AppKey[Feed] = web.AppKey("feed", Feed)
TOKEN: web.AppKey[str] = web.AppKey("token", str)
ADMIN: web.AppKey[Any] = web.AppKey("admin", object)
#: the metrics store's opener (None: no Redis URL; the sparklines say so)
METRICS: web.AppKey[Any] = web.AppKey("metrics", object)


@web.middleware
async def _headers(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        resp = exc
    resp.headers.setdefault("Content-Security-Policy", CSP)
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    resp.headers.setdefault("X-Frame-Options", "DENY")
    resp.headers.setdefault("Referrer-Policy", "no-referrer")
    if isinstance(resp, web.HTTPException):
        raise resp
    return resp


def _seq(request: web.Request) -> int | None:
    raw = request.query.get("seq", "")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text="seq: a stream sequence number") from None
    if value < 0:
        raise web.HTTPBadRequest(text="seq: a stream sequence number")
    return value


async def _fold(request: web.Request) -> Any:
    feed = request.app[FEED]
    seq = _seq(request)
    return feed.fold if seq is None else await feed.at(seq)


_enc = msgspec.json.Encoder(enc_hook=str)


def _body(body: bytes, status: int = 200, timing: str = "") -> web.Response:
    headers = {"Cache-Control": "no-store"}
    if timing:
        headers["Server-Timing"] = timing
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def _json(data: Any, status: int = 200) -> web.Response:
    if status >= 400 and isinstance(data, dict) and "error" in data:
        data = {**data, "status": status}  # the shape of every error answer (runtime.httperrors)
    return _body(_enc.encode(data), status)


class Views:
    """The views' JSON per stream sequence: a view asked again before a new event is stored is
    answered from here (a page open on each of a few browsers, the live redraws after one
    event). Keyed by (view, its query, the fold's last sequence); the last ``size`` kept."""

    def __init__(self, size: int = 64):
        self.size = size
        self._cache: OrderedDict[tuple[str, str, int], Any] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: tuple[str, str, int], compute: Callable[[], Any]) -> tuple[Any, bool]:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit, True
        self.misses += 1
        out = self._cache[key] = compute()
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return out, False

    def peek(self, key: tuple[str, str, int]) -> Any:
        return self._cache.get(key)


VIEWS: web.AppKey[Views] = web.AppKey("views", Views)


async def _cached(request: web.Request, view: str, compute: Callable[[Any], Any], raw: bool = True) -> tuple[Any, str]:
    """``compute(fold)`` for this request's fold, per (view, query, sequence); its JSON bytes when
    ``raw``. Also the ``Server-Timing`` header's value (``hit`` or the time it took)."""
    f = await _fold(request)
    t0 = time.perf_counter()
    out, hit = request.app[VIEWS].get((view, request.query_string, f.last_seq),
                                      (lambda: _enc.encode(compute(f))) if raw else (lambda: compute(f)))
    return out, f"app;dur={(time.perf_counter() - t0) * 1000:.2f};desc={'hit' if hit else 'miss'}"


def is_admin(request: web.Request) -> bool:
    given = request.headers.get("X-Console-Token", "")
    token = request.app[TOKEN]
    return bool(token) and bool(given) and hmac.compare_digest(given.encode(), token.encode())


def _same_origin(request: web.Request) -> bool:
    """The browser says where the request comes from: ``Origin`` must be this server's own and
    ``Sec-Fetch-Site``, when sent, ``same-origin``."""
    origin = request.headers.get("Origin", "")
    if origin != f"{request.scheme}://{request.host}":
        return False
    return request.headers.get("Sec-Fetch-Site", "same-origin") == "same-origin"


async def index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


async def whoami(request: web.Request) -> web.Response:
    feed = request.app[FEED]
    return _json({"admin": is_admin(request), "actions": request.app[ADMIN] is not None, "seq": feed.fold.last_seq,
                  "pid": os.getpid()})


async def overview(request: web.Request) -> web.Response:
    feed = request.app[FEED]
    out, timing = await _cached(request, "overview", projection.overview, raw=False)
    # (the rates change with the clock, not the stream: added to the cached view each time)
    rates = feed.rates() if "seq" not in request.query else {}
    return _body(_enc.encode({**out, "rates": rates}), timing=timing)


async def gpumap(request: web.Request) -> web.Response:
    """The map; with ``since=SEQ`` (the sequence of the map the page holds) only the nodes that
    changed since then, when the map at SEQ is still kept (else the whole map)."""
    q, views = request.query, request.app[VIEWS]
    filters = (q.get("label", ""), q.get("tenant", ""), q.get("priority", ""))
    # (the map at a sequence is kept per query without ``since``: the delta's two ends)
    key = "&".join(f"{k}={v}" for k, v in sorted(q.items()) if k != "since")
    f = await _fold(request)
    t0 = time.perf_counter()
    full, hit = views.get(("gpumap", key, f.last_seq), lambda: projection.gpumap(f, *filters))
    since = _int(request, "since", -1)
    old = views.peek(("gpumap", key, since)) if since >= 0 and "seq" not in q else None
    if old is not None:
        out = projection.gpumap_delta(old, full)
    else:
        out, _ = views.get(("gpumap-bytes", key, f.last_seq), lambda: _enc.encode(full))
    return _body(out if isinstance(out, bytes) else _enc.encode(out),
                 timing=f"app;dur={(time.perf_counter() - t0) * 1000:.2f};desc={'hit' if hit else 'miss'}")


async def replay(request: web.Request) -> web.Response:
    body, timing = await _cached(request, "replay", projection.replay_curve)
    return _body(body, timing=timing)


async def gpu(request: web.Request) -> web.Response:
    out = projection.gpu_detail(await _fold(request), request.query.get("node", ""), request.query.get("gpu") or None)
    return _json(out) if out is not None else _json({"error": "no such node"}, 404)


def _int(request: web.Request, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name}: a number") from None


#: the query the blocks view takes (``seq``: the moment, as every view)
BLOCKS_QUERY = ("q", "status", "cluster", "page", "per", "label", "policy", "tenant", "priority", "seq")


def _blocks_query_problems(q: Any) -> list[str]:
    """What is wrong with a blocks query, every problem: an unknown parameter, a status that is
    none, a label that is no ``key=value`` (each matched nothing and said so with an empty page)."""
    from ..schemas.lifecycle import BlockStatus

    out = [f"{k}: unknown parameter (the blocks take {', '.join(BLOCKS_QUERY)})" for k in q if k not in BLOCKS_QUERY]
    statuses = [s.value for s in BlockStatus]
    if q.get("status") and q["status"] not in statuses:
        out.append(f"status: {q['status'][:40]!r} is no status; one of {', '.join(statuses)}")
    if q.get("label") and "=" not in q["label"]:
        out.append(f"label: expected key=value, got {q['label'][:40]!r}")
    return out


async def blocks(request: web.Request) -> web.Response:
    q = request.query
    if problems := _blocks_query_problems(q):
        raise web.HTTPBadRequest(text="; ".join(problems))
    page, per = _int(request, "page", 0), _int(request, "per", 50)
    body, timing = await _cached(request, "blocks", lambda f: projection.blocks_page(
        f, q.get("q", ""), q.get("status", ""), q.get("cluster", ""), page, per, q.get("label", ""), q.get("policy", ""),
        q.get("tenant", ""), q.get("priority", "")))
    return _body(body, timing=timing)


async def block(request: web.Request) -> web.Response:
    feed, bid = request.app[FEED], request.match_info["bid"]
    seq = _seq(request)
    out = projection.block_detail(await _fold(request), bid, feed.block_events(bid, seq), feed.line)
    return _json(out) if out is not None else _json({"error": f"no block {bid}"}, 404)


#: the fields of a block's sample the sparklines draw (docs/metrics.md): ``latency_ms`` is the
#: executor's dispatch p50 (what a task waited for its answer), else the instances' mean
SPARK_FIELDS = ("inflight", "rate")


async def block_metrics(request: web.Request) -> web.Response:
    """The metrics collector's window of one block (``state.metrics``: a sample per
    ``metrics_interval_s``, the last ``metrics_window_s``), for its page's sparklines. Read from
    the store as it is, with the observer's read-only Redis user: no cost to the executors."""
    opener = request.app[METRICS]
    if opener is None:
        return _json({"samples": [], "why": "this console has no Redis URL: the collector's windows are read from Redis"})
    try:
        store = await opener()
        window = await store.window(request.match_info["bid"])
    except Exception as exc:  # (the store down: the page says so and asks again)
        return _json({"samples": [], "why": f"the metrics store did not answer: {exc}"})
    samples = [{"t": w.get("t"), "latency_ms": w.get("dispatch_p50_ms") if w.get("dispatch_p50_ms") is not None else w.get("latency_mean_ms"),
                **{k: w.get(k) for k in SPARK_FIELDS}} for w in window]
    return _json({"samples": samples})


async def tail(request: web.Request) -> web.Response:
    pattern = request.query.get("subject", "")
    items = [e for e in request.app[FEED].tail if subject_matches(pattern, e["subject"])]
    limit = max(0, _int(request, "limit", 200))  # (0 gave every event, -1 all but the first)
    return _json({"events": items[max(0, len(items) - limit):]})


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: each new stored event (``subject`` filters them, NATS wildcards)."""
    feed, pattern = request.app[FEED], request.query.get("subject", "")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=10_000)
    feed.listeners.add(queue)
    try:
        await resp.write(f"event: hello\ndata: {json.dumps({'seq': feed.fold.last_seq})}\n\n".encode())
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=15)
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if subject_matches(pattern, item["subject"]):
                await resp.write(f"data: {json.dumps(item, default=str)}\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        feed.listeners.discard(queue)
    return resp


#: the fields each action's body may hold (the page sends exactly these)
ACTION_FIELDS = {"scale": ("target",), "reassign": ("instance",), "delete": ()}


def _target_problem(target: Any) -> str | None:
    if target is None or (isinstance(target, int) and not isinstance(target, bool) and target >= 0):
        return None
    return f"target must be a count of instances >= 0, got {target!r}"


async def _action(request: web.Request, name: str,
                  problem: Callable[[dict[str, Any]], str | None] | None = None) -> tuple[Any, dict[str, Any]]:
    """The admin client and the body of action ``name``, once the token, the origin and the body
    are right. A body with fields the action does not take is refused, every such field named with
    ``problem`` (the action's own check of its fields), not half done (``{"target": 2, "colour": 1}``
    scaled to 2)."""
    if not is_admin(request):
        raise web.HTTPForbidden(text="actions need the console's admin token")
    if not _same_origin(request):
        own = f"{request.scheme}://{request.host}"
        if "Origin" not in request.headers:  # (a script's request, not another site's: say what is missing)
            raise web.HTTPForbidden(text=f"no Origin header: actions come from the console's own page (Origin {own}); "
                                         "from a script, use the CLI (blocks scale, blocks reassign, blocks delete)")
        origin = request.headers["Origin"]
        why = (f"Sec-Fetch-Site is {request.headers.get('Sec-Fetch-Site', '')[:40]!r}" if origin == own
               else f"Origin {origin[:100]!r} is not this console's ({own})")
        raise web.HTTPForbidden(text=f"cross-origin request refused: {why}")
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="a JSON body")
    opener = request.app[ADMIN]
    if opener is None:
        raise web.HTTPServiceUnavailable(text="this console has no admin credentials")
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="a JSON body") from None
    if not isinstance(body, dict):  # (a list was taken as {}: a scale by one more instance)
        raise web.HTTPBadRequest(text=f"a JSON object, got {type(body).__name__}")
    allowed = ACTION_FIELDS[name]
    problems = [f"{k}: unknown field (a {name} takes {', '.join(allowed) or 'no field'})"
                for k in body if k not in allowed]
    given = problem(body) if problem is not None else None
    problems += [given] if given else []
    if problems:
        raise web.HTTPBadRequest(text="; ".join(problems))
    return await opener(), body


async def scale(request: web.Request) -> web.Response:
    client, body = await _action(request, "scale", lambda b: _target_problem(b.get("target")))
    bid = request.match_info["bid"]
    target = body.get("target")
    try:
        if target is None:
            req = await client.scale_request(bid)
            return _json({"ok": True, "request": req.request_id})
        # as given: the client refuses what is no count ("2", 2.5, true were taken as 2, 2, 1)
        done = await client.scale_to(bid, target, reason="console", source="console")
    except LookupError as exc:
        return _json({"error": str(exc.args[0] if exc.args else exc)}, 404)
    except (ValueError, TypeError) as exc:
        return _json({"error": str(exc)}, 400)
    return _json({"ok": True, "request": done.request_id, "target": done.target, "note": done.note})


async def reassign(request: web.Request) -> web.Response:
    """Move one instance (action ``reassignment``: a new one elsewhere, then the old one goes)."""
    client, body = await _action(request, "reassign")
    try:
        req = await client.reassign_request(request.match_info["bid"], str(body.get("instance", "")), reason="console")
    except LookupError as exc:
        return _json({"error": str(exc.args[0] if exc.args else exc)}, 404)
    except ValueError as exc:
        return _json({"error": str(exc)}, 400)
    return _json({"ok": True, "request": req.request_id, "instance": req.instance_id})


async def delete(request: web.Request) -> web.Response:
    client, _ = await _action(request, "delete")
    try:
        req = await client.delete(request.match_info["bid"])
    except LookupError as exc:
        return _json({"error": str(exc.args[0] if exc.args else exc)}, 404)
    except ValueError as exc:
        return _json({"error": str(exc)}, 400)
    return _json({"ok": True, "request": req.request_id})


def make_app(feed: Feed, token: str, admin: AdminOpener | None, metrics: AdminOpener | None = None) -> web.Application:
    # inside _headers: its errors (a bad query, no token, a wrong method, an unknown path) as JSON
    app = web.Application(middlewares=[_headers, json_errors()])
    app[FEED], app[TOKEN], app[ADMIN], app[METRICS] = feed, token, admin, metrics
    app[VIEWS] = Views()
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/whoami", whoami)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/gpumap", gpumap)
    app.router.add_get("/api/gpu", gpu)
    app.router.add_get("/api/blocks", blocks)
    app.router.add_get("/api/block/{bid}", block)
    app.router.add_get("/api/block/{bid}/metrics", block_metrics)
    app.router.add_get("/api/replay", replay)
    app.router.add_get("/api/tail", tail)
    app.router.add_get("/api/events", events)
    app.router.add_post("/api/block/{bid}/scale", scale)
    app.router.add_post("/api/block/{bid}/reassign", reassign)
    app.router.add_post("/api/block/{bid}/delete", delete)
    return app


def _once(make: Callable[[], Awaitable[Any]]) -> AdminOpener:
    """``make()`` on the first call, the same object on every later one."""
    held: list[Any] = []
    lock = asyncio.Lock()

    async def open_() -> Any:
        async with lock:
            if not held:
                held.append(await make())
        return held[0]

    return open_


def admin_opener(nats_url: str | None, redis_url: str | None) -> AdminOpener | None:
    """One admin ``Client``, opened on the first action and kept."""
    if not (nats_url and redis_url):
        return None

    async def make() -> Any:
        from ..cli.client import Client

        return await Client.open(nats_url, redis_url)

    return _once(make)


def metrics_opener(redis_url: str | None) -> AdminOpener | None:
    """One read-only metrics store (``state.metrics``) on ``redis_url``, opened on the first ask."""
    if not redis_url:
        return None

    async def make() -> Any:
        from ..settings import load
        from ..state.connection import open_redis
        from ..state.metrics import MetricsStore

        return MetricsStore(open_redis(redis_url, load(), max_connections=4))

    return _once(make)


async def serve(nats_url: str, host: str, port: int, token: str, admin: AdminOpener | None,
                ready: Callable[[int], None] | None = None, stop: asyncio.Event | None = None,
                redis_url: str | None = None) -> None:
    """Read the stream as ``nats_url``'s user (and the metrics windows as ``redis_url``'s), serve
    on ``host:port`` until ``stop`` (or cancelled); ``ready(port)`` once listening (the port
    chosen when 0)."""
    from ..bus.nats_bus import Bus
    from ..projections.lines import line

    bus = await Bus.open(nats_url, source="aios-blocks/console", first_wait_s=10.0)
    feed = Feed(bus, lambda subject, env: line(subject, env)[1])  # `blocks replay`'s detail, as text
    await feed.start()
    metrics = metrics_opener(redis_url)
    runner = web.AppRunner(make_app(feed, token, admin, metrics), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        bound = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
        await feed.close()
        held = getattr(admin, "held", [])
        for c in held:
            with contextlib.suppress(Exception):
                await c.close()
        for m in getattr(metrics, "held", []):
            with contextlib.suppress(Exception):
                await m.r.aclose()
        await bus.close()
