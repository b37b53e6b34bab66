"""The CLI as issue 32 found it (items 11, 15, 16): `blocks list --json`, `--data-dir` before the
command, node types in `blocks node list`, the README's virtual-cluster example as written, ids
that stay whole at 80 columns, `top --json` without deleted blocks, a time on every replay row."""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any

import pytest

from .conftest import System
from .test_cli import BLOCKS, ROOT

README = ROOT / "README.md"


def cli(*args: str, columns: int | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`blocks ARGS` as a user runs it: no AIOS_* variable, the servers found through --data-dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([*BLOCKS, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _data_dir(system: System) -> str:
    if system.servers is None:
        pytest.skip("servers from AIOS_NATS_URL/AIOS_REDIS_URL: no data dir to name")
    return str(system.data_dir)


async def test_list_json_and_data_dir_before_or_after_the_command(system: System) -> None:
    d = _data_dir(system)
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "flags-1",
                                               "minInstances": 1, "maxInstances": 1})
    assert kind == "ready"
    for args in (["--data-dir", d, "list", "--json"], ["list", "--json", "--data-dir", d],
                 ["--data-dir", "/nowhere", "list", "--json", "--data-dir", d]):  # the one after the command wins
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr)
        rows = json.loads(r.stdout)
        assert {"id": "flags-1", "status": "ready", "cluster": "c1", "reason": None, "instances": 1, "short": None} \
            == {k: v for k, v in rows[0].items() if k != "gen"}, rows
    r = cli("--data-dir", d, "list", "--data-dir", "/nowhere")
    assert r.returncode == 2 and "/nowhere" in r.stderr
    r = cli("--data-dir", d, "list")
    assert r.returncode == 0 and "flags-1" in r.stdout and "ready" in r.stdout


async def test_node_list_shows_node_types(system: System) -> None:
    d = _data_dir(system)
    assert cli("cluster", "add", "typed", "--nodes", "2", "--gpus", "1", "--node-type", "A100", "--data-dir", d).returncode == 0
    assert cli("cluster", "add", "plain", "--nodes", "1", "--gpus", "1", "--data-dir", d).returncode == 0
    r = cli("node", "list", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    types = {n["node_id"]: n["node_type"] for n in json.loads(r.stdout)}
    # the nodeType label, else the first GPU's model: what virtual clusters' replica sets count
    assert types == {"typed-n0": "A100", "typed-n1": "A100", "plain-n0": "sim-h100"}, types
    r = cli("node", "list", "--data-dir", d, columns=200)
    header = next(line for line in r.stdout.splitlines() if "node" in line and "cluster" in line)
    assert "type" in header
    assert re.search(r"typed-n0\s*│\s*typed\s*│\s*A100\s*│", r.stdout), r.stdout


def _readme_commands(prefix: str) -> list[str]:
    """The README "Using it" block's lines that start with ``prefix``, comments cut."""
    text = README.read_text()
    block = text[text.index("## Using it"):]
    block = block[block.index("```bash") + 7:]
    block = block[:block.index("```")]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith(prefix)]


async def test_the_readme_virtual_cluster_example_works_as_written(system: System) -> None:
    d = _data_dir(system)
    [add] = _readme_commands("blocks cluster add")
    [create] = [c for c in _readme_commands("blocks vcluster create")]
    [update] = [c for c in _readme_commands("blocks vcluster update")]
    for line in (add, create.replace(" ID ", " team-a ").replace("[--divisible] ", ""),
                 update.replace(" ID ", " team-a ").replace(" R ", " 1 ")):
        argv = [a.strip("'") for a in re.findall(r"'[^']*'|\S+", line)][1:]
        r = cli(*argv, "--data-dir", d)
        assert r.returncode == 0, (line, r.stdout, r.stderr)
    r = cli("vcluster", "get", "team-a", "--json", "--data-dir", d)
    assert json.loads(r.stdout)["vcluster"]["counts"] == {"A100": 3}


async def test_ids_stay_whole_in_tables_at_80_columns(system: System) -> None:
    d = _data_dir(system)
    await system.client.add_sim_cluster("c1", nodes=2, gpus=2)
    bid = "flags-a-rather-long-block-id-0123456789"
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": bid,
                                               "minInstances": 2, "maxInstances": 2})
    assert kind == "ready"
    for args, ids in ((["get", bid], [f"{bid}-0", f"{bid}-1"]), (["list"], [bid]), (["node", "list"], ["c1-n0", "c1-n1"])):
        r = cli(*args, "--data-dir", d, columns=80)
        assert r.returncode == 0, r.stderr
        for i in ids:
            assert any(i in line for line in r.stdout.splitlines()), (args, i, r.stdout)


async def test_top_json_leaves_deleted_blocks_out(system: System) -> None:
    d = _data_dir(system)
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    for bid in ("top-live", "top-gone"):
        _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": bid,
                                                   "minInstances": 1, "maxInstances": 1})
        assert kind == "ready"
    assert cli("delete", "top-gone", "--data-dir", d).returncode == 0
    sample: dict[str, Any] = {"cluster": "c1", "ready": 1, "instances": 1, "t": 0}
    # a collector's sample of a block that was deleted (or never existed) since: stale, not a block to show
    await system.client.store.metrics.write({b: (sample, {}) for b in ("top-live", "top-gone", "top-ghost")}, 5, 60)
    r = cli("top", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    shown = set(json.loads(r.stdout)["blocks"])
    assert "top-live" in shown and not shown & {"top-gone", "top-ghost"}, shown


async def test_top_piped_prints_a_table_each_interval(system: System) -> None:
    # piped (`blocks top | less`, a log), the live view wrote nothing until it was stopped
    import asyncio
    import signal

    d = _data_dir(system)
    await system.client.add_sim_cluster("c1", nodes=1, gpus=2)
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "top-piped",
                                               "minInstances": 1, "maxInstances": 1})
    assert kind == "ready"
    sample: dict[str, Any] = {"cluster": "c1", "ready": 1, "instances": 1, "t": 0}
    await system.client.store.metrics.write({"top-piped": (sample, {})}, 5, 60)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(*BLOCKS, "top", "--interval", "0.2", "--data-dir", d, env=env, cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                start_new_session=True)
    try:
        assert proc.stdout is not None
        titles = 0
        async with asyncio.timeout(60):
            while titles < 2:  # (a line at a time: the pipe is read as it is written)
                line = (await proc.stdout.readline()).decode()
                assert line, "blocks top ended"
                titles += line.startswith("blocks (metrics collector")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await proc.wait()


async def test_replay_gives_every_row_a_time_a_bare_create_too(system: System) -> None:
    d = _data_dir(system)
    # a bare spec, as any NATS client may publish it: no envelope, no `time` of its own; the parser
    # stores it in AIOS as its submitted CloudEvent, the create step replay shows
    # (no cluster here: with queue: false it fails at once rather than waiting pending, issue 36)
    spec = {"blockComponentURI": "aios://test/model", "blockId": "bare-1", "minInstances": 1, "maxInstances": 1, "queue": False}
    ack = await system.client.bus.js.publish("aios.block.bare-1.create", json.dumps(spec).encode())
    await system.client.wait("bare-1", 60)
    r = cli("replay", "bare-1", "--json", "--data-dir", d)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert first["subject"] == "aios.block.bare-1.submitted" and first["event"]["time"], first
    assert first["event"]["data"]["spec"] == spec and first["event"]["data"]["gen"] == ack.seq
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["stored"]), first
    r = cli("replay", "bare-1", "--data-dir", d)
    create = next(line for line in r.stdout.splitlines() if " submitted " in line)
    assert re.match(r"\s*\d+ \d\d:\d\d:\d\d\.\d{3} bare-1\s+submitted\s+gen=\d+ bare spec on aios.block.bare-1.create", create), create
