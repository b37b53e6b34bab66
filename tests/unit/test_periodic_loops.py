"""The last four hand-written periodic loops (the executor's weights, scrape, collected-metrics and
passive-health loops; the outputs' drain; the remote-write flush; the side-car's fetch) run on
``runtime.ticker.Ticker`` (issue 35: one ticker for every periodic loop), with the behaviour they
had: a failed step is logged and the next comes, ``stop`` ends them, what is due at a stop is done."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp

from aios_blocks import sidecar
from aios_blocks.bus.catalog import Emit
from aios_blocks.executor.engine import Weighted
from aios_blocks.executor.outputs import OutputPublisher
from aios_blocks.metrics.remote_write import RemoteWrite
from aios_blocks.schemas.errors import PolicyFailed
from aios_blocks.settings import Settings
from aios_blocks.workers.executor import Executor

SRC = Path(__file__).resolve().parents[2] / "src" / "aios_blocks"
MODULES = ["workers/executor.py", "executor/outputs.py", "metrics/remote_write.py", "sidecar.py"]
#: not periodic: the side-car retries its first subscribe until the stream is there, then fetches
ALLOWED = {("sidecar.py", "serve")}


def _timed_loops(path: Path) -> list[str]:
    """``while`` loops that pace themselves: a sleep, or a wait on an event with a timeout."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for loop in (n for n in ast.walk(fn) if isinstance(n, ast.While)):
            for call in (c for c in ast.walk(loop) if isinstance(c, ast.Call)):
                name = ast.unparse(call.func)
                if name in ("asyncio.sleep", "_sleep") or (name == "asyncio.wait_for" and ".wait()" in ast.unparse(call.args[0])):
                    found.append(f"{fn.name}:{loop.lineno}")
    return [f for f in found if (path.name, f.split(":")[0]) not in ALLOWED]


def test_no_hand_written_periodic_loop_is_left_in_the_four_modules() -> None:
    assert {m: _timed_loops(SRC / m) for m in MODULES} == {m: [] for m in MODULES}


# -- the executor's loops --------------------------------------------------------------------------
def _executor(**parts: Any) -> Any:
    """What the loops read of an ``Executor`` (its routes, its worker's runtime and store, settings)."""
    s = Settings(executor_weights_interval_s=0.01, metrics_interval_s=0.01, outlier_publish_s=0.01)
    return SimpleNamespace(s=s, routes=parts.pop("routes", {}), w=SimpleNamespace(**parts))


async def _until(cond: Any, stop: asyncio.Event | None = None) -> None:
    async with asyncio.timeout(5):
        while not cond():
            await asyncio.sleep(0.005)
    if stop is not None:
        stop.set()


async def test_the_weights_loop_outlives_an_error_that_is_not_a_policy_failure() -> None:
    """Before the ticker a ``KeyError`` (a policy's answer without ``weights``) ended the loop:
    the block's weights were frozen from then on."""
    calls: list[int] = []

    async def invoke(rule: dict[str, Any], rule_id: str, data: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            return {}  # no "weights": KeyError
        if len(calls) == 2:
            raise PolicyFailed("loadBalancer", "boom")
        return {"weights": {"b1-0": 1.0}}

    route = SimpleNamespace(views={"b1-0": {"id": "b1-0", "state": "ready"}})
    chooser = Weighted("s.star")
    ex = _executor(routes={"b1": route}, runtime=SimpleNamespace(invoke=invoke))
    task = asyncio.create_task(Executor._weights_loop(ex, "b1", {"policyRuleURI": "s.star"}, chooser))
    try:
        await _until(lambda: len(calls) >= 3 and chooser.error == "")
    finally:
        task.cancel()
    assert len(calls) >= 3 and chooser.weights == {"b1-0": 1.0}


async def test_the_collected_and_passive_loops_go_on_after_redis_errors_and_end_at_stop() -> None:
    reads: list[list[str]] = []
    writes: list[dict[str, Any]] = []
    collected: dict[str, Any] = {}

    async def instances_many(bids: list[str]) -> dict[str, Any]:
        reads.append(bids)
        if len(reads) == 1:
            raise ConnectionError("redis away")
        return {"b1": {"b1-0": {"gpu_util": 0.5}}}

    async def write_passive(holder: str, per_block: dict[str, Any], ttl: float) -> None:
        writes.append(per_block)
        if len(writes) == 1:
            raise ConnectionError("redis away")

    outliers = SimpleNamespace(snapshot=lambda views: {"b1-0": {"errors": 0}})
    route = SimpleNamespace(views={"b1-0": {}}, outliers=outliers, set_collected=collected.__setitem__)
    store = SimpleNamespace(metrics=SimpleNamespace(instances_many=instances_many),
                            health=SimpleNamespace(write_passive=write_passive))
    ex = _executor(routes={"b1": route}, store=store)
    ex.collected_tick = lambda: Executor.collected_tick(ex)
    stop = asyncio.Event()
    loops = asyncio.gather(Executor.collected_loop(ex, stop), Executor.passive_loop(ex, stop))
    await _until(lambda: len(reads) >= 3 and len(writes) >= 3, stop)
    await asyncio.wait_for(loops, 5)
    assert collected == {"b1-0": {"gpu_util": 0.5}} and writes[-1] == {"b1": {"b1-0": {"errors": 0}}}


async def test_the_scrape_loop_ticks_until_stop() -> None:
    scraped: list[str] = []

    async def scrape(route: Any, v: dict[str, Any], timeout: aiohttp.ClientTimeout) -> None:
        scraped.append(v["id"])
        raise aiohttp.ClientError("instance away")  # gathered: never the loop's end

    route = SimpleNamespace(chooser=SimpleNamespace(name="builtin:least-queue"),
                            views={"b1-0": {"id": "b1-0", "state": "ready", "endpoint": "http://x"}})
    ex = _executor(routes={"b1": route})
    ex.s = Settings(executor_scrape_interval_s=0.01)
    ex._scrape = scrape
    stop = asyncio.Event()
    loop = asyncio.create_task(Executor.scrape_loop(ex, stop))
    await _until(lambda: len(scraped) >= 3, stop)
    await asyncio.wait_for(loop, 5)


# -- the outputs' drain -----------------------------------------------------------------------------
class _Bus:
    def __init__(self, down: bool = False) -> None:
        self.sent: list[Emit] = []
        self.down = down
        self.tries = 0

    async def emit_all(self, effects: list[Emit]) -> list[Any]:
        self.tries += 1
        if self.down:
            raise ConnectionError("nats away")
        self.sent.extend(effects)
        return []


async def test_outputs_left_at_a_stop_are_published_in_batches_or_dropped_once_nats_refuses() -> None:
    bus = _Bus()
    pub = OutputPublisher(bus, Settings(outputs_linger_ms=0))
    stop = asyncio.Event()
    stop.set()  # stopped before the loop ever ran: what is buffered still goes, in batches of 2
    for n in range(5):
        pub.offer("b1", f"t{n}", "b1-0", 200, b"x")
    await asyncio.wait_for(pub.run(stop, batch=2), 5)
    assert [e.payload.task_id for e in bus.sent] == [f"t{n}" for n in range(5)] and bus.tries == 3

    away = _Bus(down=True)
    pub = OutputPublisher(away, Settings(outputs_linger_ms=0))
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    pub.offer("b1", "t0", "b1-0", 200, b"x")
    await _until(lambda: away.tries >= 2, stop)  # retried with backoff while running
    await asyncio.wait_for(task, 5)
    assert pub.published == 0 and pub.dropped == 1 and pub.pending == 0 and pub.retried >= 3


# -- the remote-write flush -------------------------------------------------------------------------
async def test_remote_write_flushes_every_interval_goes_on_after_a_failed_flush_and_once_more_at_stop() -> None:
    flushes: list[bool] = []

    class Counted(RemoteWrite):
        async def flush(self, session: aiohttp.ClientSession) -> None:
            flushes.append(stop.is_set())
            if len(flushes) == 1:
                raise RuntimeError("receiver away")

    stop = asyncio.Event()
    task = asyncio.create_task(Counted([]).run(stop, 0.01))
    await _until(lambda: len(flushes) >= 3, stop)
    await asyncio.wait_for(task, 5)
    assert flushes[-1] is True and not any(flushes[:3])  # the last one after the stop


# -- the side-car's fetch ---------------------------------------------------------------------------
async def test_the_sidecar_fetches_again_after_a_failed_fetch_and_settles_what_came() -> None:
    settled: list[Any] = []
    takes: list[int] = []

    class Puller:
        async def take(self, batch: int, timeout: float) -> list[Any]:
            takes.append(batch)
            if len(takes) == 1:
                raise TimeoutError("nats reconnecting")
            return [f"m{len(takes)}"]

    async def settle(bus: Any, proc: Any, msg: Any, durable: str) -> None:
        settled.append(msg)

    assert "_fetching" in dict(inspect.getmembers(sidecar))
    original, sidecar._settle = sidecar._settle, settle  # type: ignore[assignment]
    try:
        stop = asyncio.Event()
        task = asyncio.create_task(sidecar._fetching(None, None, Puller(), "d", 7, stop))  # type: ignore[arg-type]
        await _until(lambda: len(settled) >= 2, stop)
        await asyncio.wait_for(task, 5)
    finally:
        sidecar._settle = original  # type: ignore[assignment]
    assert settled[:2] == ["m2", "m3"] and set(takes) == {7}
