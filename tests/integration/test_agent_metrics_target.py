"""A node agent's own ``/metrics`` (``blocks agent --metrics-port``) is a Prometheus target like a
worker's: its heartbeats carry the URL, the controller's health monitor registers it (kind
``agent``, for ``metrics_target_ttl_s``: it lapses once the agent falls silent), and ``blocks
prometheus-config`` (and the collector's http_sd) list it. It was served on 127.0.0.1 and listed
nowhere. A real ``blocks agent`` process against the real servers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from aios_blocks.runtime.embedded import free_port

from .conftest import System


async def test_an_agents_metrics_port_is_in_the_prometheus_config(system: System, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url}
    env.pop("AIOS_REDIS_URL", None)  # an agent needs only NATS
    if system.servers is not None:
        env.update(system.servers.agent_env("am-n0"))  # as the node's own user
    log = open(tmp_path / "agent.log", "ab")  # noqa: ASYNC230 (the agent's log, once)
    agent = subprocess.Popen(  # noqa: ASYNC220 (a process of its own, run the whole test)
        [sys.executable, "-m", "aios_blocks.cli", "agent", "--node-id", "am-n0", "--cluster", "am", "--runtime", "sim",
         "--sim-gpus", "1", "--heartbeat-s", "0.5", "--metrics-port", str(port), "--agent-dir", str(tmp_path / "agent")],
        env=env, stdout=log, stderr=log, start_new_session=True)
    log.close()
    try:
        async with asyncio.timeout(90):
            while not await system.client.store.metrics.targets("agent"):
                assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
                await asyncio.sleep(0.2)
        [target] = await system.client.store.metrics.targets("agent")
        assert target["url"] == f"http://127.0.0.1:{port}/metrics" and target["cluster"] == "am", target
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(target["url"], timeout=10).read().decode())
        assert "python_info" in body or "process_" in body, body[:300]  # it serves what it says
        r = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "aios_blocks.cli", "prometheus-config", "--static"],
            env={**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url},
            capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        [job] = [j for j in yaml.safe_load(r.stdout)["scrape_configs"] if j["job_name"] == "aios-workers"]
        groups = [g for g in job["static_configs"] if g["labels"].get("kind") == "agent"]
        assert groups == [{"targets": [f"127.0.0.1:{port}"], "labels": {"kind": "agent", "worker": "agent-am-n0",
                                                                          "cluster": "am"}}], job
    finally:
        agent.terminate()
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
