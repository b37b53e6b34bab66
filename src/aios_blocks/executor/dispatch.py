"""Dispatch: one task to one instance of its block (admission, the loadBalancer's choice, retries),
over one pooled aiohttp session. A task is tried on another instance (bounded, with backoff) only
when it never reached the first (connection refused, or ``421 Misdirected Request``: another
instance now serves that endpoint and ran nothing), or when it is marked ``Aios-Idempotent:
true``; otherwise the instance's failure is the answer, so a task is never sent twice without that
mark. Each attempt names its instance (``Aios-Instance``, ``schemas.protocol``) and, with the
system's instance key (``AIOS_INSTANCE_KEY``), carries its token (``Aios-Instance-Token``,
``runtime.instance_key``: computed from the map's node and instance ids). The ingress
(``executor/ingress.py``) turns tasks into calls of :meth:`Dispatcher.dispatch`; the routes are the
executor's (``workers/executor.py``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..runtime.instance_key import token as instance_token
from ..schemas.protocol import INSTANCE_HEADER, INSTANCE_TOKEN_HEADER, MISDIRECTED
from ..schemas.records import RouteView, TaskInfo
from ..settings import Settings
from .engine import Refused, Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer",
               "proxy-authorization", "proxy-authenticate"}
#: a task's headers the executor does not pass on: hop-by-hop ones, and ``Aios-Instance`` and
#: ``Aios-Instance-Token``, which it sets (a caller's own token is never passed on)
DROP_HEADERS = HOP_HEADERS | {INSTANCE_HEADER.lower(), INSTANCE_TOKEN_HEADER.lower()}
RETRY_STATUSES = (502, 503, 504)
#: the longest time limit a task may ask for (``Aios-Timeout-Ms``): one day
MAX_TASK_TIMEOUT_MS = 86_400_000

#: what a caller does with the accepted answer (reads it whole, or streams it on)
Consume = Callable[[aiohttp.ClientResponse, RouteView], Awaitable[Any]]


#: the values ``Aios-Idempotent`` may take (any case): yes, and no
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in TRUE_WORDS


def header_problems(headers: Mapping[str, str]) -> list[str]:
    """Every problem of a task's ``Aios-Timeout-Ms`` and ``Aios-Idempotent`` headers, as the caller
    gets them in one refusal (400) beside its ``Aios-Task-Id``'s (``outputs.task_id_of``): a bad
    time limit was reported alone, and ``Aios-Idempotent: maybe`` was taken as no."""
    out = []
    tmo = headers.get("Aios-Timeout-Ms") or headers.get("aios-timeout-ms")
    if tmo:
        try:
            task_timeout_s(tmo)
        except Refused as r:
            out.append(r.reason)
    idem = headers.get("Aios-Idempotent") or headers.get("aios-idempotent")
    if idem is not None and idem.strip().lower() not in TRUE_WORDS + FALSE_WORDS:
        out.append(f"Aios-Idempotent must be true or false, got {idem[:40]!r}")
    return out


def task_timeout_s(header: str) -> float:
    """The task's time limit from its ``Aios-Timeout-Ms`` header, in seconds: a number of
    milliseconds above 0 and at most a day (``inf``, ``nan``, ``0`` and negatives are refused
    with 400, not taken as "no time left" or as no limit)."""
    try:
        ms = float(header)
    except ValueError:
        raise Refused(400, f"Aios-Timeout-Ms must be a number of milliseconds, got {header!r}") from None
    if not (0 < ms <= MAX_TASK_TIMEOUT_MS):  # nan fails every comparison
        raise Refused(400, f"Aios-Timeout-Ms must be above 0 and at most {MAX_TASK_TIMEOUT_MS} (a day), got {header!r}")
    return ms / 1000


@dataclass
class Task:
    """One task as dispatch sends it: where, what, how long it may take, whether it may be sent twice."""

    method: str
    target: str
    body: bytes
    headers: dict[str, str]
    idempotent: bool
    timeout_s: float
    #: what the loadBalancer policy sees of it
    info: TaskInfo
    #: the loop time its whole budget ends (queue, every attempt, backoff)
    deadline: float = 0.0

    @classmethod
    def of(cls, method: str, target: str, body: bytes, headers: Mapping[str, str], default_timeout_s: float) -> Task:
        idempotent = truthy(headers.get("Aios-Idempotent") or headers.get("aios-idempotent"))
        tmo = headers.get("Aios-Timeout-Ms") or headers.get("aios-timeout-ms")
        fwd = {k: v for k, v in headers.items() if k.lower() not in DROP_HEADERS and not k.lower().startswith("nats-")}
        info: TaskInfo = {"method": method, "path": target, "bytes": len(body), "idempotent": idempotent,
                "content_type": headers.get("Content-Type") or headers.get("content-type") or ""}
        return cls(method, target, body, fwd, idempotent, task_timeout_s(tmo) if tmo else default_timeout_s, info)


class Dispatcher:
    """Sends tasks to the instances of ``routes`` (the executor's, by block). ``cluster``: a pinned
    executor's cluster (its refusals say so)."""

    def __init__(self, routes: dict[str, Route], settings: Settings, cluster: str | None = None,
                 fetch: Callable[[str], Awaitable[Route | None]] | None = None):
        self.routes = routes
        self.s = settings
        self.cluster = cluster
        #: reads a block's map from the bucket when ``routes`` has none yet: the map watch may trail
        #: the bucket (a caller that saw block.ready and sent a task at once got 404)
        self.fetch = fetch
        self._fetching: dict[str, asyncio.Future[Route | None]] = {}
        self.session: aiohttp.ClientSession | None = None
        #: tasks for a block with no map (one unlabelled counter: block ids from callers are unbounded)
        self.unknown_tasks = 0

    async def route(self, bid: str) -> Route:
        route = self.routes.get(bid)
        if route is not None:
            return route
        if self.fetch is not None:
            route = await self._fetch_once(bid)
            if route is not None:
                return route
        self.unknown_tasks += 1
        if self.cluster is not None:
            raise Refused(404, f"block {bid!r} is not served here: this executor serves cluster {self.cluster} only")
        raise Refused(404, f"unknown block {bid!r}: no instance map (never placed, or deleted)")

    async def _fetch_once(self, bid: str) -> Route | None:
        """One bucket read for all the tasks that miss the same block at once."""
        assert self.fetch is not None
        pending = self._fetching.get(bid)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Route | None] = asyncio.get_running_loop().create_future()
        self._fetching[bid] = fut
        route: Route | None = None
        try:
            route = await self.fetch(bid)
        except Exception:  # the bucket unreadable for a moment: the task is told the block is unknown
            route = None
        finally:  # cancelled too: the others waiting are answered
            del self._fetching[bid]
            fut.set_result(route)
        return route

    async def dispatch(self, bid: str, method: str, path: str | None, body: bytes, headers: dict[str, str], consume: Consume) -> Any:
        """Send one task to one instance of the block (admission, policy, retries) and hand the
        accepted response to ``consume``. Raises :class:`Refused` with the reason otherwise."""
        route = await self.route(bid)
        assert self.session is not None
        task = Task.of(method, path if path is not None else route.path, body, headers, self.s.executor_task_timeout_s)
        loop = asyncio.get_running_loop()
        task.deadline = loop.time() + task.timeout_s
        tried: set[str] = set()
        last = ""
        retries = self.s.executor_retries
        for attempt in range(retries + 1):
            if task.deadline - loop.time() <= 0:
                raise Refused(504, (f"{last}; " if last else "") + f"the task's time limit ({task.timeout_s * 1000:g} ms) ran out")
            try:
                v = await route.acquire(task.info, frozenset(tried), task.deadline)
            except Refused as r:  # no other instance: say what became of the last try too
                if last:
                    r.reason = f"{last}; {r.reason}"
                raise
            done, result, last = await self._attempt(route, v, task, attempt < retries, consume)
            if done:
                return result
            if attempt < retries:
                tried.add(v["id"])
                route.retried += 1
                route.stats.retries += 1
                await asyncio.sleep(min(0.5, 0.01 * 2 ** (attempt + 1)) * (0.5 + random.random()))
        raise Refused(502, f"{last}; gave up after {retries + 1} attempt(s)")

    async def _attempt(self, route: Route, v: RouteView, task: Task, may_retry: bool, consume: Consume) -> tuple[bool, Any, str]:
        """One try at instance ``v``: (True, what ``consume`` made, '') or (False, None, why it
        failed, to try another). A failure that must not be retried raises Refused."""
        assert self.session is not None
        iid = v["id"]
        if v["inflight"] == 1:  # progress: since when this instance has work (executor.outlier)
            route.outliers.get(iid).busy_since = time.monotonic()
        t0 = time.perf_counter()
        ok, outcome, last = False, "", ""
        timeout = aiohttp.ClientTimeout(total=max(0.001, task.deadline - asyncio.get_running_loop().time()))
        task.headers[INSTANCE_HEADER] = iid  # the instance meant: another one at that endpoint refuses (421)
        if self.s.instance_key:  # its own token, from the map's node and instance ids (runtime.instance_key)
            task.headers[INSTANCE_TOKEN_HEADER] = instance_token(self.s.instance_key, v.get("node", ""), iid)
        try:
            async with self.session.request(task.method, v["endpoint"] + task.target, data=task.body, headers=task.headers,
                                            timeout=timeout) as resp:
                if resp.status == MISDIRECTED:  # another instance serves the endpoint now; it ran nothing
                    await resp.read()
                    route.stats.misdirected += 1
                    outcome = "connect"  # as unreachable: ejected here until the map catches up
                    last = (f"instance {iid} is no longer at {v['endpoint']}: another instance there answered "
                            f"421 Misdirected Request (the task was not run)")
                    return False, None, last
                outcome = "5xx" if resp.status >= 500 else "ok"
                if resp.status in RETRY_STATUSES and task.idempotent and may_retry:
                    await resp.read()
                    last = f"instance {iid} answered {resp.status}"
                    return False, None, last
                ok = resp.status < 500
                return True, await consume(resp, v), ""
        except aiohttp.ClientConnectorError as exc:  # never reached the instance: safe to try another
            ok, outcome, last = False, "connect", f"instance {iid} unreachable: {exc}"
            return False, None, last
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok = False
            # a failure after the answer began (the caller went away mid-stream) says nothing of the instance
            if not outcome:
                outcome = "timeout" if isinstance(exc, TimeoutError) else "reset"
            what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {type(exc).__name__}: {exc}"
            last = f"instance {iid} {what}"
            if not task.idempotent:
                raise Refused(504 if isinstance(exc, TimeoutError) else 502,
                              f"{last}; not retried (the task is not marked Aios-Idempotent: true)") from None
            return False, None, last
        finally:
            took = time.perf_counter() - t0
            route.release(v, took, ok)
            if outcome:
                route.record(v, outcome, last, took)
