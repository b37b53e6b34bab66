"""The process runtime's ``start`` returns an instance its own ``list`` and ``find`` see at once:
the process is its own record (its labels in ``/proc/<pid>/environ``), and ``Popen`` (vfork) goes
on while the child is still inside ``execve``, when that environ reads empty. An agent's inventory
taken right after a start must not miss the instance. Real processes, started and stopped here."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from aios_blocks.agent.runtime import LaunchSpec
from aios_blocks.agent.runtime_process import ProcessRuntime, labelled, last_output, process_scope


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


async def test_an_instance_that_exits_says_why_with_its_last_output(tmp_path: Path) -> None:
    # it was reported as only "exited with code 1" (e.g. `python -m ...` on a PATH whose python lacks
    # the package): its output was in instance.log, which goes with its working directory
    rt = ProcessRuntime(scope=process_scope(tmp_path / "agent"))
    work = tmp_path / "work"
    work.mkdir()
    code = "import sys; print('loading', flush=True); print('ModuleNotFoundError: No module named x', file=sys.stderr); sys.exit(1)"
    inst = await rt.start(LaunchSpec(instance_id="i0", block_id="b", node_id=f"exit-{uuid.uuid4().hex[:8]}", gen=1,
                                     command=[sys.executable, "-c", code], workdir=work))
    try:
        for _ in range(200):
            st = await rt.status(inst.handle)
            if st is not None and not st.running:
                break
            await asyncio.sleep(0.05)
        assert st is not None and not st.running and st.exit_code == 1
        assert st.detail == "last output 'loading | ModuleNotFoundError: No module named x'", st.detail
    finally:
        await rt.stop(inst.handle, 0)
    assert last_output(None) == "" and last_output(tmp_path / "none.log") == ""


async def test_a_commands_python_is_the_agents_own_when_its_venv_is_not_on_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`.venv/bin/blocks agent` run without activating the venv: the shipped examples' `python -m
    aios_blocks.examples.echo` could not exec `python` (or got one without the package); the
    agent's own Python's directory now comes first on the instance's PATH."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-python-here"))
    rt = ProcessRuntime(scope=process_scope(tmp_path / "agent"))
    work = tmp_path / "work"
    work.mkdir()
    code = "import sys, aios_blocks; print('ran', sys.prefix, flush=True); sys.exit(3)"
    inst = await rt.start(LaunchSpec(instance_id="i0", block_id="b", node_id=f"py-{uuid.uuid4().hex[:8]}", gen=1,
                                     command=["python", "-c", code], workdir=work))
    try:
        for _ in range(400):
            st = await rt.status(inst.handle)
            if st is not None and not st.running:
                break
            await asyncio.sleep(0.05)
        assert st is not None and not st.running and st.exit_code == 3, st
        assert st.detail == f"last output 'ran {sys.prefix}'", st.detail
    finally:
        await rt.stop(inst.handle, 0)
