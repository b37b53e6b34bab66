"""The HTTP servers users call answer every error as JSON with its status (runtime/httperrors.py):
an unknown path, a wrong method, a bad query, a refused action. aiohttp's own answers to those were
plain text (``405: Method Not Allowed``), unlike the same servers' other errors."""

from __future__ import annotations

from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aios_blocks.cli.client import Client
from aios_blocks.console.feed import Feed
from aios_blocks.console.server import make_app
from aios_blocks.executor.ingress import Ingress
from aios_blocks.runtime.httperrors import json_errors


async def _json_error(http: TestClient[Any, Any], method: str, path: str, status: int) -> dict[str, Any]:
    async with http.request(method, path) as r:
        assert r.status == status, (method, path, r.status, await r.text())
        assert r.content_type == "application/json", (method, path, r.content_type, await r.text())
        body = await r.json()
        assert body["status"] == status and isinstance(body["error"], str) and body["error"], body
        return cast(dict[str, Any], body)


async def test_the_consoles_api_answers_its_errors_as_json() -> None:
    feed = Feed(cast(Any, None), lambda subject, env: subject)  # not started: an empty fold
    async with TestClient(TestServer(make_app(feed, "t0ken", None))) as http:
        assert (await _json_error(http, "GET", "/api/nothing", 404))["error"] == "no such endpoint: GET /api/nothing"
        wrong = await _json_error(http, "POST", "/api/overview", 405)
        assert wrong["error"].startswith("method POST not allowed on /api/overview") and "GET" in wrong["error"]
        async with http.post("/api/overview") as r:
            assert "GET" in r.headers["Allow"] and r.headers["X-Frame-Options"] == "DENY"  # (kept, and _headers' too)
        assert (await _json_error(http, "GET", "/api/blocks?page=abc", 400))["error"] == "page: a number"
        assert (await _json_error(http, "GET", "/api/overview?seq=-1", 400))["error"] == "seq: a stream sequence number"
        assert (await _json_error(http, "POST", "/api/block/b1/scale", 403))["error"] == "actions need the console's admin token"
        assert (await _json_error(http, "GET", "/api/block/b1/scale", 405))["error"].startswith("method GET not allowed")
        assert (await _json_error(http, "GET", "/api/block/nope", 404))["error"] == "no block nope"  # (was JSON already)
        async with http.get("/api/whoami") as r:  # answers are left as they were
            assert r.status == 200 and (await r.json())["admin"] is False


async def test_the_executors_http_ingress_answers_an_unknown_path_and_a_wrong_method_as_json() -> None:
    ingress = Ingress(cast(Any, None), cast(Any, None), set(), 0)  # (neither reached: no task goes through)
    async with TestClient(TestServer(ingress.app())) as http:
        body = await _json_error(http, "GET", "/nothing", 404)
        assert body == {"error": "no such endpoint: GET /nothing", "status": 404, "retry_after_ms": None}  # its refusals' shape
        assert (await _json_error(http, "POST", "/health", 405))["error"] == "method POST not allowed on /health; allowed: GET,HEAD"


async def test_the_middleware_leaves_answers_and_redirects_alone() -> None:
    async def fine(request: web.Request) -> web.Response:
        return web.Response(text="plain and fine", status=418)

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/fine")

    async def teapot(request: web.Request) -> web.Response:
        raise web.HTTPServiceUnavailable(text="not now", headers={"Retry-After": "3"})

    app = web.Application(middlewares=[json_errors(extra_field=1)])
    app.router.add_get("/fine", fine)
    app.router.add_get("/moved", moved)
    app.router.add_get("/busy", teapot)
    async with TestClient(TestServer(app)) as http:
        async with http.get("/fine") as r:
            assert r.status == 418 and await r.text() == "plain and fine"
        async with http.get("/moved", allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"] == "/fine"
        async with http.get("/busy") as r:
            assert r.status == 503 and r.headers["Retry-After"] == "3"
            assert await r.json() == {"error": "not now", "status": 503, "extra_field": 1}


async def test_the_consoles_actions_refuse_what_is_no_count_or_no_object_and_tail_counts_from_the_end() -> None:
    """A scale target that is no count is the client's ValueError (``"abc"`` was Python's
    ``invalid literal for int()``, ``2.5`` and ``true`` were taken as 2 and 1); a body that is JSON
    but no object is refused (a list was taken as ``{}``: a scale by one more instance); the tail's
    ``limit`` counts events from the end (0 gave them all, -1 all but the first)."""
    client = Client(None, None)  # type: ignore[arg-type]  # (no bus, no store: a 400 proves nothing was touched)

    async def admin() -> Client:
        return client

    feed = Feed(cast(Any, None), lambda subject, env: subject)
    for seq in (1, 2, 3):
        feed.tail.append({"seq": seq, "ts": 0.0, "subject": f"aios.block.b{seq}.ready", "line": ""})
    async with TestClient(TestServer(make_app(feed, "t0ken", admin))) as http:
        headers = {"X-Console-Token": "t0ken", "Origin": f"http://{http.host}:{http.port}"}
        for target in ("abc", 2.5, True, -1):
            async with http.post("/api/block/b1/scale", json={"target": target}, headers=headers) as r:
                assert r.status == 400, (target, await r.text())
                assert (await r.json())["error"] == f"target must be a count of instances >= 0, got {target!r}"
        for body in ([1], "2", 3):
            async with http.post("/api/block/b1/scale", json=body, headers=headers) as r:
                assert r.status == 400 and (await r.json())["error"].startswith("a JSON object, got "), (body, await r.text())
        for limit, seqs in (("0", []), ("2", [2, 3]), ("9", [1, 2, 3]), ("-1", [])):
            async with http.get(f"/api/tail?limit={limit}") as r:
                assert [e["seq"] for e in (await r.json())["events"]] == seqs, limit


async def test_the_consoles_actions_refuse_a_field_they_do_not_take_naming_every_problem() -> None:
    """``{"target": 2, "colour": 1}`` scaled the block to 2 and said nothing of ``colour``; a
    delete or a reassign took any field too. Each action now refuses a body with a field it does not
    take, every such field named with the action's own problems, before anything is sent (the client
    has no bus: a 400 proves nothing was touched)."""
    client = Client(None, None)  # type: ignore[arg-type]

    async def admin() -> Client:
        return client

    feed = Feed(cast(Any, None), lambda subject, env: subject)
    async with TestClient(TestServer(make_app(feed, "t0ken", admin))) as http:
        headers = {"X-Console-Token": "t0ken", "Origin": f"http://{http.host}:{http.port}"}
        cases = [
            ("scale", {"target": 2, "colour": 1}, "colour: unknown field (a scale takes target)"),
            ("scale", {"target": "x", "colour": 1, "size": 2},
             "colour: unknown field (a scale takes target); size: unknown field (a scale takes target); "
             "target must be a count of instances >= 0, got 'x'"),
            ("reassign", {"instance": "b1-0", "node": "n2"}, "node: unknown field (a reassign takes instance)"),
            ("delete", {"force": True}, "force: unknown field (a delete takes no field)"),
        ]
        for action, body, says in cases:
            async with http.post(f"/api/block/b1/{action}", json=body, headers=headers) as r:
                assert r.status == 400, (action, body, r.status, await r.text())
                assert await r.json() == {"error": says, "status": 400}, (action, body)


async def test_an_action_without_origin_says_what_is_missing_and_another_origin_names_both() -> None:
    """An action from a script (curl, no Origin) was told "cross-origin request refused", as if it
    came from another site: it now says that the Origin is missing and that scripts use the CLI;
    another site's request names its Origin and the console's."""
    async def admin() -> Client:
        raise AssertionError("refused before the client is opened")

    feed = Feed(cast(Any, None), lambda subject, env: subject)
    async with TestClient(TestServer(make_app(feed, "t0ken", admin))) as http:
        own = f"http://{http.host}:{http.port}"
        for headers, says in (
            ({}, f"no Origin header: actions come from the console's own page (Origin {own}); from a script, use the CLI"),
            ({"Origin": "http://evil.example"}, f"cross-origin request refused: Origin 'http://evil.example' is not this "
                                                f"console's ({own})"),
            ({"Origin": own, "Sec-Fetch-Site": "cross-site"}, "cross-origin request refused: Sec-Fetch-Site is 'cross-site'"),
        ):
            async with http.post("/api/block/b1/delete", json={}, headers={"X-Console-Token": "t0ken", **headers}) as r:
                body = await r.json()
                assert r.status == 403 and body["error"].startswith(says), (headers, body)


async def test_the_blocks_query_refuses_what_would_match_nothing_naming_every_problem() -> None:
    """`/api/blocks?status=bogus&size=2&label=gold` answered an empty page (a status that is none,
    a label that is no key=value and an unknown parameter each matched nothing, silently): now one
    400 naming each; the page's own queries still answer."""
    feed = Feed(cast(Any, None), lambda subject, env: subject)
    async with TestClient(TestServer(make_app(feed, "t0ken", None))) as http:
        body = await _json_error(http, "GET", "/api/blocks?status=bogus&size=2&label=gold", 400)
        assert body["error"].split("; ")[0] == ("size: unknown parameter (the blocks take q, status, cluster, page, per, "
                                                "label, policy, tenant, priority, seq)"), body
        assert "status: 'bogus' is no status; one of parsed, rejected" in body["error"], body
        assert body["error"].endswith("label: expected key=value, got 'gold'"), body
        async with http.get("/api/blocks?q=&status=ready&cluster=&tenant=&priority=&label=qos%3Dgold&policy=&page=0&per=50") as r:
            assert r.status == 200 and (await r.json())["rows"] == []
