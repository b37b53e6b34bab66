"""The process runtime's ``start`` returns an instance its own ``list`` and ``find`` see at once:
the process is its own record (its labels in ``/proc/<pid>/environ``), and ``Popen`` (vfork) goes
on while the child is still inside ``execve``, when that environ reads empty. An agent's inventory
taken right after a start must not miss the instance. Real processes, started and stopped here."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from aios_blocks.agent.runtime import LaunchSpec
from aios_blocks.agent.runtime_process import ProcessRuntime, labelled, process_scope


async def test_an_instance_is_listed_and_found_as_soon_as_it_is_started(tmp_path: Path) -> None:
    rt = ProcessRuntime(scope=process_scope(tmp_path / "agent"))
    node = f"start-{uuid.uuid4().hex[:8]}"
    for k in range(100):  # the moment inside execve is short: without the wait some 1 start in 20 was missed
        inst = await rt.start(LaunchSpec(instance_id=f"i{k}", block_id="b", node_id=node, gen=1, command=["sleep", "60"]))
        try:
            assert [i.handle for i in await rt.list(node)] == [inst.handle], k
            found = await rt.find(node, f"i{k}")
            assert found is not None and found.handle == inst.handle
        finally:
            await rt.stop(inst.handle, 0)
    assert await rt.list(node) == []


def test_labelled_returns_when_the_process_has_ended_without_labels() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])  # no labels: it never carries any
    try:
        assert labelled(proc).pid == proc.pid
    finally:
        proc.wait()
