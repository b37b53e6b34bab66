"""The OCR block end to end: a node agent with the process runtime, the OCR component, one
block of it, and a few example images (made here with Pillow) sent to it; prints what it read.

For ``make demo`` (the integrator passes ``send`` to route tasks through the executor)::

    from aios_blocks.examples.ocr import demo
    results = await demo.run(client, data_dir, send=my_send)   # my_send(bid, task_dict) -> answer dict

Standalone, against a running ``blocks up`` (same data dir)::

    python -m aios_blocks.examples.ocr.demo [--data-dir .aios-data]

Tasks are JSON ``{"image_b64": ...}`` so any transport (HTTP or NATS) carries them; without
``send`` they go through the executors over NATS (``Client.task``): the instance's own endpoint
(``POST {endpoint}/ocr``) takes tasks only from them when auth is on (its token, docs/security.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from . import COMPONENT_URI, available, component, sample_png

Send = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
TEXTS = ("Hello Blocks 42", "AIOS OCR demo", "PP-OCRv4 model")
NODE_ID = "ocr-node-0"
CLUSTER = "ocr-cpu"


def start_agent(data_dir: Path, node_id: str = NODE_ID, cluster: str = CLUSTER, log: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``blocks agent --runtime process`` for one CPU node of its own cluster (it takes the local
    ``blocks up``'s credentials from ``data_dir``; AIOS_NATS_URL in ``env`` wins when set)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", node_id, "--cluster", cluster,
             "--runtime", "process", "--cpu", "2", "--memory", "4096", "--heartbeat-s", "1",
             "--agent-dir", str(data_dir / "ocr-agent"), "--data-dir", str(data_dir)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


async def direct_send(endpoint: str, path: str) -> Send:
    import aiohttp

    async def send(bid: str, task: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.post(f"{endpoint}{path}", json=task) as r:
            body: dict[str, Any] = await r.json()
            if r.status != 200:
                raise RuntimeError(f"instance answered {r.status}: {body}")
            return body

    return send


def executor_send(client: Any) -> Send:
    """Tasks through the executors (``aios.block.B.task``), which add the instance's token."""
    import json

    async def send(bid: str, task: dict[str, Any]) -> dict[str, Any]:
        status, raw, _ = await client.task(bid, json.dumps(task).encode(), {"Content-Type": "application/json"})
        body: dict[str, Any] = json.loads(raw) if raw else {}
        if status != 200:
            raise RuntimeError(f"the block answered {status}: {body}")
        return body

    return send


async def run(client: Any, data_dir: Path, send: Send | None = None, texts: tuple[str, ...] = TEXTS,
              timeout: float = 180.0, say: Callable[[str], None] = print, keep: bool = False,
              agent_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Place the OCR block and read ``texts`` back from images of them; returns each answer with
    ``expected`` added. ``keep``: leave the block and its agent running (else both are stopped).
    ``agent_env``: the node agent's environment (default this process's)."""
    why = available()
    if why:
        raise RuntimeError(why)
    logs = data_dir / "logs"
    agent = start_agent(data_dir, log=logs / "ocr-agent.log" if logs.is_dir() else None, env=agent_env)
    bid = ""
    try:
        async with asyncio.timeout(60):
            while await client.store.node_meta(NODE_ID) is None:
                if agent.poll() is not None:
                    raise RuntimeError(f"the OCR node agent exited ({agent.returncode})")
                await asyncio.sleep(0.2)
        comp = await client.add_component(component())
        say(f"registered component {comp.componentURI} (PP-OCRv4 on CPU) and node {NODE_ID} (process runtime)")
        started = time.perf_counter()
        # pinned to the agent's node: simulated clusters beside it would take the block too, and a
        # simulated instance only echoes
        pin = [{"category": "Resource", "strength": "Required", "target": {"type": "NodeId", "value": NODE_ID}}]
        bid = await client.submit({"blockComponentURI": COMPONENT_URI, "minInstances": 1, "maxInstances": 1, "affinity": pin})
        kind, env = await client.wait(bid, timeout)
        if kind != "ready":
            raise RuntimeError(f"OCR block {bid} ended {kind}: {env.get('data')}")
        (inst,) = (await client.store.instances(bid)).values()
        say(f"OCR block {bid} ready in {time.perf_counter() - started:.1f}s; instance at {inst['endpoint']}")
        if send is None:
            send = executor_send(client)
        results = []
        for text in texts:
            answer = await send(bid, {"image_b64": base64.b64encode(sample_png(text)).decode()})
            answer["expected"] = text
            say(f"  image of {text!r:22} -> {answer.get('text')!r} ({answer.get('elapsed_ms')} ms)")
            results.append(answer)
        return results
    finally:
        if not keep:
            if bid:
                with contextlib.suppress(Exception):
                    await client.delete(bid)
                    for _ in range(150):  # up to 30 s: the instance is stopped before its agent
                        b = await client.store.get_block(bid)
                        if not b or b["status"] == "deleted":
                            break
                        await asyncio.sleep(0.2)
            agent.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(10)


def main() -> None:
    import argparse

    from ...cli.client import Client
    from ...cli.common import _urls

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path(".aios-data"))
    args = p.parse_args()

    async def go() -> int:
        nats_url, redis_url = _urls(args.data_dir)
        client = await Client.open(nats_url, redis_url)
        try:
            results = await run(client, args.data_dir)
        finally:
            await client.close()
        return 0 if all(r.get("text") == r["expected"] for r in results) else 1

    raise SystemExit(asyncio.run(go()))


if __name__ == "__main__":
    main()
