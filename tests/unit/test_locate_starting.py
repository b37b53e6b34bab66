"""A command typed right after ``blocks up &`` waits for the servers that are starting. Found
following the README as a stranger: its lines, pasted at once after ``blocks up &`` (and the lines
`make demo` prints), said "No servers" because `blocks up` had not written endpoints.json yet."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from aios_blocks.runtime import lifetime
from aios_blocks.runtime.locate import resolve_urls, starting


@pytest.fixture(autouse=True)
def _no_server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AIOS_NATS_URL", "AIOS_REDIS_URL", "AIOS_ROLE"):
        monkeypatch.delenv(var, raising=False)


def _resolve_in_thread(data: Path, told: threading.Event, out: list[object], wait_s: float = 600) -> threading.Thread:
    def run() -> None:
        out.append(resolve_urls(data, wait_s=wait_s, on_wait=lambda d: told.set()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_command_waits_for_a_blocks_up_that_is_starting_and_gets_its_servers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    lock = lifetime.DataDirLock(data).acquire()  # what `blocks up` holds from its first moment
    try:
        assert starting(data)
        told, out = threading.Event(), []
        t = _resolve_in_thread(data, told, out)
        assert told.wait(30), "the command did not say it waits"
        assert t.is_alive() and not out  # still waiting: no endpoints.json yet
        (data / "endpoints.json").write_text(json.dumps({"nats": "nats://127.0.0.1:4999", "redis": "redis://127.0.0.1:6999/0",
                                                         "auth": False}))
        t.join(30)
        assert not t.is_alive()
        assert out == [("nats://127.0.0.1:4999", "redis://127.0.0.1:6999/0")]
        assert not starting(data)  # started
    finally:
        lock.release()


def test_a_blocks_up_that_gives_up_ends_the_wait_with_no_servers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    lock = lifetime.DataDirLock(data).acquire()
    told, out = threading.Event(), []
    try:
        t = _resolve_in_thread(data, told, out)
        assert told.wait(30)
    finally:
        lock.release()  # it failed to start: nothing holds the lock, no endpoints.json
    t.join(30)  # (a bound for the test, not a speed: the wait itself would last 600 s)
    assert not t.is_alive()
    assert out == [None]


def test_nothing_starting_means_no_wait(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    told: list[Path] = []
    assert not starting(data)
    assert resolve_urls(data, wait_s=600, on_wait=told.append) is None
    assert told == []
    (data / "lock").write_text("12345")  # left by a `blocks up` that stopped: nobody holds it
    assert resolve_urls(data, wait_s=600, on_wait=told.append) is None
    assert told == []


def test_blocks_up_holds_the_data_dirs_lock_before_it_execs_into_its_lean_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is what tells a command that a `blocks up` is starting: it is taken before the
    exec (the lean process imports for a second or more before it starts its servers), and the
    exec-ed process gets it as ``--lock-fd``."""
    import os

    from aios_blocks.cli import up

    data = tmp_path / "data"
    execs: list[list[str]] = []

    def fake_exec(path: str, argv: list[str]) -> None:
        execs.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(up.os, "execv", fake_exec)
    with pytest.raises(SystemExit):
        up.exec_up(data, {"parser": 1}, False)
    (argv,) = execs
    fd = int(argv[argv.index("--lock-fd") + 1])
    try:
        assert os.get_inheritable(fd)  # it survives the exec
        assert starting(data)  # a command run now waits for this `blocks up`
        with pytest.raises(lifetime.DataDirBusy):  # and a second one is refused at once
            lifetime.DataDirLock(data).acquire()
        adopted = lifetime.DataDirLock.adopt(data, fd)  # what the exec-ed process does with it
        assert not os.get_inheritable(fd)
        adopted.release()
        assert not starting(data)
    finally:
        with pytest.raises(OSError):
            os.close(fd)  # (closed by the release)
