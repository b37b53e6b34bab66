"""compose.yaml's ``cluster`` profile has the layout tests/integration/test_cluster.py runs: three
NATS servers routed to each other with JetStream, six Redis Cluster nodes and the one-shot that
joins them. Docker may be absent where the tests run, so this checks the file: its structure, and
each NATS server's configuration as ``nats-server -t`` (the same binary) reads it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from aios_blocks.runtime.embedded import nats_binary

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _cluster(kind: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _compose()["services"].items() if s.get("profiles") == ["cluster"] and n.startswith(kind)}


def test_the_default_services_stay_out_of_the_profile() -> None:
    services = _compose()["services"]
    assert "profiles" not in services["nats"] and "profiles" not in services["redis"]


def test_three_nats_servers_route_to_each_other() -> None:
    nats = _cluster("nats-")
    assert sorted(nats) == ["nats-1", "nats-2", "nats-3"]
    conf = _compose()["configs"]["nats-cluster"]["content"]
    routes = sorted(int(p) for p in re.findall(r"nats-route://127\.0\.0\.1:(\d+)", conf))
    assert routes == sorted(int(s["environment"]["NATS_ROUTE_PORT"]) for s in nats.values())
    names = {s["environment"]["NATS_NAME"] for s in nats.values()}
    ports = {s["environment"]["NATS_PORT"] for s in nats.values()}
    assert len(names) == len(ports) == 3
    assert "sync_interval: always" in conf  # the embedded server's durability


@pytest.mark.parametrize("name", ["nats-1", "nats-2", "nats-3"])
def test_each_nats_server_config_is_valid(name: str, tmp_path: Path) -> None:
    svc = _cluster("nats-")[name]
    conf = _compose()["configs"]["nats-cluster"]["content"].replace("$$", "$")  # compose's escape
    path = tmp_path / "cluster.conf"
    path.write_text(conf.replace("/data", str(tmp_path / "js")))
    env = {k: str(v) for k, v in svc["environment"].items()}
    r = subprocess.run([nats_binary(), "-c", str(path), "-t"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert svc["command"] == ["-c", svc["configs"][0]["target"]]


def test_six_redis_nodes_and_the_cluster_create() -> None:
    redis = _cluster("redis-")
    nodes = {n: s for n, s in redis.items() if n != "redis-cluster-create"}
    assert len(nodes) == 6
    ports = sorted(s["environment"]["REDIS_PORT"] for s in nodes.values())
    assert len(set(ports)) == 6 and all(int(p) <= 55535 for p in ports)  # the bus port is +10000
    start = " ".join(next(iter(nodes.values()))["entrypoint"])
    assert "--cluster-enabled yes" in start and '"$$REDIS_PORT"' in start
    create = redis["redis-cluster-create"]
    assert set(create["depends_on"]) == set(nodes)
    cmd = " ".join(create["command"])
    assert sorted(re.findall(r"127\.0\.0\.1:(\d+)", cmd.split("--cluster create", 1)[1])) == ports
    assert "--cluster-replicas 1" in cmd
