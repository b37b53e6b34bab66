"""An instance's own port answers only the executors (docs/security.md "Instances' ports: a token
per instance"): a real instance (the SDK's echo example, process runtime, a real `blocks agent`
given its node's key as `blocks up` gives it) placed by the system refuses a task sent straight to
its port without its token or with a wrong one (401) and answers the same task through the
executor (which adds its token); the simulated fleet's instances do the same. No stored event and
no log line holds the token or a key it comes from."""

from __future__ import annotations

import json

import aiohttp
import pytest

from aios_blocks.runtime import instance_key
from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import COMPONENT, System
from .test_agent import Agents
from .test_instance_sdk import ECHO, process_agents  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
async def keyed_agents(process_agents: Agents) -> Agents:  # noqa: F811
    """test_instance_sdk's process agents, on the embedded servers with auth on (they make the key)."""
    if process_agents.system.servers is None or not process_agents.system.servers.auth:
        pytest.skip("the embedded servers with auth on: they make the instance key")
    return process_agents


async def _direct(endpoint: str, path: str, headers: dict[str, str], method: str = "POST") -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.request(method, endpoint + path, json={"q": "hi"}, headers=headers) as r:
        return r.status, await r.text()


async def _stored_texts(system: System) -> list[bytes]:
    """Every stored message of every stream (data and headers), as bytes."""
    js = system.client.bus.nc.jetstream()
    out: list[bytes] = []
    for info in await js.streams_info():
        name, state = info.config.name, info.state
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                msg = await js.get_msg(name, seq)
            except Exception:  # deleted in between
                continue
            out.append((msg.data or b"") + json.dumps(msg.headers or {}).encode())
    return out


def _secrets_absent(secrets: list[str], texts: list[bytes], where: str) -> None:
    for s in secrets:
        for t in texts:
            assert s.encode() not in t, f"a secret found in {where}"


async def test_a_real_instance_answers_only_the_executor(keyed_agents: Agents) -> None:
    system = keyed_agents.system
    c = system.client
    key = instance_key.read(system.data_dir)
    assert key, "blocks up's servers make the key with auth on"
    assert (instance_key.path(system.data_dir).stat().st_mode & 0o777) == 0o600
    keyed_agents.start("n1")
    await keyed_agents.wait_registered("n1")
    await c.add_component(ECHO)
    bid, kind, env = await system.submit_and_wait(
        {"blockComponentURI": "aios://test/echo-sdk", "minInstances": 1, "maxInstances": 1}, timeout=120)
    assert kind == "ready", env
    ((iid, rec),) = (await c.store.instances(bid)).items()
    endpoint, token = rec["endpoint"], instance_key.token(key, "n1", iid)
    (inst,) = [i for i in await keyed_agents.runtime().list("n1") if i.instance_id == iid]
    assert (await keyed_agents.environment(inst))["AIOS_INSTANCE_TOKEN"] == token  # what its agent gave it

    # straight to its port: no token, another instance's, the node key or K itself -> 401, unrun
    for headers in ({}, {"Aios-Instance-Token": instance_key.token(key, "n1", iid + "x")},
                    {"Aios-Instance-Token": instance_key.node_key(key, "n1")}, {"Aios-Instance-Token": key},
                    {"Aios-Instance-Token": instance_key.token(key, "n2", iid), "Aios-Instance": iid}):
        status, body = await _direct(endpoint, "/v1/echo", headers)
        assert status == 401 and "Aios-Instance-Token" in body, (headers, status, body)
        assert token not in body
    assert (await _direct(endpoint, "/elsewhere", {}, "GET"))[0] == 401  # every path but the two open ones
    for path in ("/health", "/metrics"):  # open: the probes, the checker, the collector read them
        assert (await _direct(endpoint, path, {}, "GET"))[0] == 200
    metrics = (await _direct(endpoint, "/metrics", {}, "GET"))[1]
    assert "aios_instance_requests_total 0.0" in metrics or "aios_instance_requests_total 0" in metrics  # nothing ran

    # through the executor (it holds K and computes the token from the map): answered
    status, body, _ = await c.task(bid, json.dumps({"q": "hi"}).encode(), {"Content-Type": "application/json"})
    assert status == 200 and json.loads(body) == {"instance_id": iid, "output": {"q": "hi"}}
    # a caller's own token header is not passed on (the executor sets it): still answered
    status, _, _ = await c.task(bid, b'{"q": 1}', {"Content-Type": "application/json", "Aios-Instance-Token": "forged"})
    assert status == 200
    # the right token straight to the port also works (it is the token, not the path, that counts)
    assert (await _direct(endpoint, "/v1/echo", {"Aios-Instance-Token": token}))[0] == 200

    # no stored event and no log line holds the token, the node's key or K
    secrets = [token, instance_key.node_key(key, "n1"), key]
    stored = await _stored_texts(system)
    assert any(f"instance.{iid}.added".encode() in t for t in stored)  # the scan reads the events (the start command too)
    assert any(iid.encode() in t and b'"launch"' in t for t in stored)  # its start command (what observers read)
    _secrets_absent(secrets, stored, "a stored event")
    logs = [p.read_bytes() for p in [*(system.data_dir / "logs").glob("*.log"), *keyed_agents.base.glob("agent-*.log")]]
    logs += [p.read_bytes() for p in (keyed_agents.base / "agent").rglob("*.log")]  # the instance's own output
    assert logs
    _secrets_absent(secrets, logs, "a log")


async def test_a_simulated_instance_answers_only_the_executor(system: System) -> None:
    if system.servers is None or not system.servers.auth:
        pytest.skip("the embedded servers with auth on: they make the instance key")
    key = instance_key.read(system.data_dir)
    assert key
    c = system.client
    await c.add_cluster(Cluster(id="tk"))
    await c.add_node(Node(id="tk-n1", cluster="tk", gpus=[Gpu(id="tk-g0")]))
    comp = dict(COMPONENT, componentURI="aios://test/token-sim")
    await c.add_component(comp)
    bid, kind, env = await system.submit_and_wait({"blockComponentURI": "aios://test/token-sim", "minInstances": 1, "maxInstances": 1}, timeout=60)
    assert kind == "ready", env
    ((iid, rec),) = (await c.store.instances(bid)).items()
    endpoint, path = rec["endpoint"], "/infer"  # COMPONENT names no input protocol
    for headers in ({}, {"Aios-Instance-Token": "wrong"}):
        assert (await _direct(endpoint, path, headers))[0] == 401
    assert (await _direct(endpoint, "/health", {}, "GET"))[0] == 200
    assert (await _direct(endpoint, path, {"Aios-Instance-Token": instance_key.token(key, rec["node"], iid)}))[0] == 200
    status, body, _ = await c.task(bid, b'{"q": 2}', {"Content-Type": "application/json"})
    assert status == 200 and json.loads(body)["instance_id"] == iid
