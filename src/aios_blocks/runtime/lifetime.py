"""How long the processes of ``blocks up`` live, and who may use a data dir.

* ``die_with_parent``: a ``preexec_fn`` that asks Linux to SIGTERM the child when the process that
  started it dies (``PR_SET_PDEATHSIG``), so a SIGKILLed ``blocks up`` leaves no nats-server,
  redis-server or worker behind. The signal follows the *thread* that forked the child, so spawn
  from a thread that lives as long as the child should (the main thread, or the supervisor's).
* ``DataDirLock``: one ``blocks up`` per data dir (a second nats-server on the same store or a
  second Redis on the same AOF corrupts both). An exclusive ``flock`` on ``<data dir>/lock``
  holding the owner's PID; the servers inherit it, so it is free only once all of them are gone.
* ``stop_on_signals``: SIGTERM and SIGHUP stop like Ctrl-C, and SIGINT works even when the shell
  started us in the background with SIGINT ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> Any:
    """The C library, loaded on first use: finding it runs ``ldconfig`` (tens of ms that every CLI
    command would pay at start-up, where only ``blocks up`` needs it)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (``None`` where the OS has no such call)."""
    libc = _libc()
    if libc is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


class DataDirBusy(RuntimeError):
    """Another process holds the data dir."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        self.data_dir, self.pid = data_dir, pid
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"{data_dir} is in use by {who} (another `blocks up`?): stop it first, or use another --data-dir")


class DataDirLock:
    """Exclusive use of a data dir, for as long as this process or a child it passes ``fd`` to lives."""

    NAME = "lock"

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / self.NAME
        self.fd: int | None = None

    def acquire(self) -> DataDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DataDirBusy(self.path.parent, holder(self.path.parent)) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    @classmethod
    def adopt(cls, data_dir: Path, fd: int) -> DataDirLock:
        """The lock a process held before it ``exec``-ed into this one (`blocks up` takes it before
        it replaces itself, so that no moment passes without it), passed as the open ``fd``."""
        lock = cls(data_dir)
        os.set_inheritable(fd, False)
        lock.fd = fd
        return lock

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None


def holder(data_dir: Path) -> int | None:
    """PID written by the process that holds (or last held) the data dir's lock."""
    try:
        text = (Path(data_dir) / DataDirLock.NAME).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def in_use(data_dir: Path) -> bool:
    """Whether some process holds the data dir's lock (a running ``blocks up`` or its servers)."""
    path = Path(data_dir) / DataDirLock.NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)) -> Iterator[None]:
    """Inside: the first of ``signals`` raises ``KeyboardInterrupt`` in the main thread (so the
    caller's ``finally`` stops everything in order); later ones are ignored while it stops."""
    fired: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if fired:
            return
        fired.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
