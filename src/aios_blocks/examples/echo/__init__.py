"""A light instance written with the SDK (no model): answers a JSON task with it, for the tests
and benchmarks of the block services. Run it as an instance with ``python -m aios_blocks.examples.echo``.

Task (JSON): any value; a dict may ask for ``{"sleep_ms": N}`` (service time), ``{"fail": true}``
(answered 500), ``{"stream": N}`` (N NDJSON chunks). Answer: ``{"instance_id", "output": task}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ...instance import Context, Reply, Task, TaskError


async def handle(task: Task, ctx: Context) -> Any:
    data = task.json()
    if isinstance(data, dict):
        if data.get("sleep_ms"):
            await asyncio.sleep(min(float(data["sleep_ms"]), 60_000) / 1000)
        if data.get("fail"):
            raise TaskError(500, "failed on request")
        n = data.get("stream")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return Reply(_chunks(ctx.instance_id, min(n, 10_000)))
    return {"instance_id": ctx.instance_id, "output": data}


async def _chunks(iid: str, n: int) -> AsyncIterator[dict[str, Any]]:
    for i in range(n):
        yield {"instance_id": iid, "chunk": i}
