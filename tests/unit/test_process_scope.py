"""The process runtime's scope: processes are host-wide, so two systems on one host whose agents
use the same node names (two `blocks up` data dirs, two test runs) must not see each other's
instances. Real processes, started and stopped here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from aios_blocks.agent.runtime import LABEL_SCOPE, LaunchSpec
from aios_blocks.agent.runtime_process import LABELS_ENV, ProcessRuntime, labelled, process_scope

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def spec(node: str, iid: str) -> LaunchSpec:
    return LaunchSpec(instance_id=iid, block_id="b", node_id=node, gen=1, command=SLEEP)


async def test_two_systems_with_the_same_node_name_see_only_their_own_processes(tmp_path: Path) -> None:
    node = f"scope-{uuid.uuid4().hex[:8]}"  # same node name, same instance id, two agent directories
    a, b = ProcessRuntime(scope=process_scope(tmp_path / "sys-a" / "agent")), ProcessRuntime(scope=process_scope(tmp_path / "sys-b" / "agent"))
    assert a.scope != b.scope and process_scope(tmp_path / "sys-a" / "agent") == a.scope  # stable per directory
    legacy = None
    started = []
    try:
        ia, ib = await a.start(spec(node, "x-0")), await b.start(spec(node, "x-0"))
        started = [(a, ia.handle), (b, ib.handle)]
        assert ia.labels[LABEL_SCOPE] == a.scope
        assert [i.handle for i in await a.list(node)] == [ia.handle]
        assert [i.handle for i in await b.list(node)] == [ib.handle]
        found = await ProcessRuntime(scope=a.scope).find(node, "x-0")  # a restarted agent of system a
        assert found is not None and found.handle == ia.handle
        # an unscoped view (a tool) sees both; a process started before scopes (no label) is seen by each
        assert {i.handle for i in await ProcessRuntime().list(node)} == {ia.handle, ib.handle}
        labels = spec(node, "old-0").labels()
        env = {"PATH": os.environ.get("PATH", ""), LABELS_ENV: json.dumps(labels)}
        legacy = await asyncio.to_thread(subprocess.Popen, SLEEP, env=env, start_new_session=True)
        await asyncio.to_thread(labelled, legacy)  # Popen may return while it is still inside execve
        pid = str(legacy.pid)
        for rt in (a, b):
            assert any(i.handle.startswith(pid + "-") for i in await rt.list(node))
        # stopping is scoped too: system b's teardown leaves system a's instance running
        for inst in await b.list(node):
            if inst.instance_id == "x-0":
                await b.stop(inst.handle, 0)
        [left] = [i for i in await a.list(node) if i.instance_id == "x-0"]
        assert left.handle == ia.handle and left.running
    finally:
        for rt, h in started:
            await rt.stop(h, 0)
        if legacy is not None:
            legacy.kill()
            await asyncio.to_thread(legacy.wait)
    assert await ProcessRuntime().list(node) == []
