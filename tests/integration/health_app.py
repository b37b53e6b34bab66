"""An instance the health tests run as its own process (so it can be SIGKILLed): POST /infer
answers after ``DELAY`` seconds, GET /health at once. Args: PORT NAME DELAY."""

import asyncio
import sys

from aiohttp import web

port, name, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])


async def infer(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(delay)
    return web.json_response({"instance": name})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ready"})


app = web.Application()
app.router.add_post("/infer", infer)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
