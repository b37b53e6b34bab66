"""Idle footprint of ``blocks up`` (issue 14: at most 300 MiB RSS over all its processes).

Starts ``blocks up --data-dir <tmp>`` as a real process (the default layout: embedded
nats-server and redis-server, every worker kind, grouped in three worker processes:
``supervisor.DEFAULT_GROUPS``; with ``--process-per-kind``, one process per kind as before),
waits until every worker process has come up (each one's log says ``telemetry.serving``) and the
memory has settled, then sums over the whole process tree:

* **RSS** (``VmRSS``: what the issue's target is judged by); pages shared between processes (the
  interpreter, shared libraries) count once per process;
* **PSS** (``/proc/PID/smaps_rollup``): shared pages divided among the processes sharing them, so
  the sum is what the tree costs the machine.

The notes give each process's share (``kind rss/pss`` in MiB; a group process is labelled with
its kinds, ``parser+gateway+controller``). Then ``blocks up`` gets SIGTERM and
every process of the tree must be gone within 20 s (figure: processes left; any left are killed).
Figures only; a run takes ~15 s.

    .venv/bin/python -m bench.footprint                      # the default: grouped
    .venv/bin/python -m bench.footprint --process-per-kind   # one process per kind
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

GROUP = "11 footprint"
MiB = 1024.0


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{name}/stat").read_text()
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    return kids


def tree(root: int) -> list[int]:
    """``root`` and every process below it (workers and servers run in sessions of their own, but
    stay its children)."""
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def label(pid: int) -> str:
    """``blocks up`` (the supervising process: ``blocks up`` execs ``python -m aios_blocks.cli.up``),
    the worker kind, or the server's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    if "aios_blocks.runtime.main" in words:  # a kind, or a group's kinds (parser+gateway+controller)
        return "".join(words[words.index("aios_blocks.runtime.main") + 1:][:1]) or "worker"
    first = Path(words[0].split()[0]).name if words else ""
    if first in ("nats-server", "redis-server"):  # redis-server rewrites its title: "redis-server host:port"
        return first
    if "aios_blocks.cli.up" in words or (any(Path(w).name == "blocks" for w in words[:2]) and "up" in words):
        return "blocks up"
    return Path(words[0]).name if words else "?"


def memory(pid: int) -> tuple[float, float, int] | None:
    """(RSS, PSS) in KiB and the thread count of ``pid``; None once it is gone."""
    try:
        fields = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[key] = float(rest.split()[0])
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    return fields.get("Rss", 0.0), fields.get("Pss", 0.0), threads


def sample(root: int) -> list[tuple[int, str, float, float, int]]:
    """(pid, label, rss KiB, pss KiB, threads) of every live process of the tree."""
    out = []
    for pid in tree(root):
        m = memory(pid)
        if m is not None:
            out.append((pid, label(pid), *m))
    return out


def _ready(logs: Path, kinds: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"blocks up exited with {proc.returncode}")
        files = list(logs.glob("*.log")) if logs.exists() else []
        if len(files) >= kinds and all("telemetry.serving" in f.read_text(errors="replace") for f in files):
            return
        time.sleep(0.25)
    raise RuntimeError(f"blocks up: workers not serving within {timeout}s (logs in {logs})")


def _settled(root: int, timeout: float = 20.0) -> list[tuple[int, str, float, float, int]]:
    """A sample once the total RSS moved by under 1 MiB over the last 2 s (or at the timeout)."""
    deadline, last = time.time() + timeout, None
    while True:
        time.sleep(2.0)
        now = sample(root)
        total = sum(s[2] for s in now)
        if (last is not None and abs(total - last) < MiB) or time.time() > deadline:
            return now
        last = total


def measure(per_kind: bool = False) -> tuple[list[tuple[int, str, float, float, int]], int]:
    """The settled idle sample of a fresh ``blocks up`` (``--process-per-kind`` with ``per_kind``)
    and the processes left after SIGTERM."""
    from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, DEFAULT_LAYOUT, units

    data = Path(tempfile.mkdtemp(prefix="aios-footprint-"))
    blocks = Path(sys.executable).parent / "blocks"
    cmd = [str(blocks)] if blocks.exists() else [sys.executable, "-m", "aios_blocks.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("AIOS_NATS_URL", "AIOS_REDIS_URL", "AIOS_PROCESS_PER_KIND")}
    env["AIOS_LOG_LEVEL"] = "info"  # readiness is read from the workers' "telemetry.serving" lines
    out = open(data / "up.out", "wb")
    flags = ["--process-per-kind"] if per_kind else []
    proc = subprocess.Popen([*cmd, "up", "--data-dir", str(data / "d"), *flags], env=env, stdout=out, stderr=subprocess.STDOUT)
    pids: dict[int, str | None] = {}
    try:
        _ready(data / "d" / "logs", len(units(DEFAULT_LAYOUT, None if per_kind else DEFAULT_GROUPS)), proc)
        idle = _settled(proc.pid)
        pids = {s[0]: _start_time(s[0]) for s in idle}
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        deadline = time.time() + 20
        while time.time() < deadline and any(_start_time(p) == t for p, t in pids.items()):
            time.sleep(0.1)
        left = [p for p, t in pids.items() if _start_time(p) == t]
        return idle, len(left)
    finally:
        for pid, t in pids.items():  # nothing may outlive the run, whatever happened
            if _start_time(pid) == t:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        shutil.rmtree(data, ignore_errors=True)


def figures(quick: bool = False) -> list[common.Row]:
    per_kind = "--process-per-kind" in sys.argv
    idle, left = measure(per_kind)
    order = {"blocks up": 0, "nats-server": 98, "redis-server": 99}
    idle.sort(key=lambda s: (order.get(s[1], 1), s[1]))
    rss, pss = sum(s[2] for s in idle) / MiB, sum(s[3] for s in idle) / MiB
    per_rss = ", ".join(f"{s[1]} {s[2] / MiB:.1f}" for s in idle)
    per_pss = ", ".join(f"{s[1]} {s[3] / MiB:.1f}" for s in idle)
    pythons = [s for s in idle if s[1] not in ("nats-server", "redis-server")]
    return [
        common.row(GROUP, "blocks up idle: RSS, all processes", rss, "MiB", None,
                   f"target (issue 14) <= 300 MiB RSS; {'a process per kind' if per_kind else 'kinds grouped'}, "
                   f"{len(idle)} processes, per process (MiB): {per_rss}"),
        common.row(GROUP, "blocks up idle: PSS, all processes", pss, "MiB", None,
                   f"shared pages split among their sharers (smaps_rollup); per process (MiB): {per_pss}"),
        common.row(GROUP, "blocks up idle: processes", len(idle), "", None,
                   f"{len(pythons)} Python, threads: " + ", ".join(f"{s[1]} {s[4]}" for s in idle)),
        common.row(GROUP, "blocks up idle: largest Python process RSS", max((s[2] for s in pythons), default=0) / MiB, "MiB"),
        common.row(GROUP, "processes left 20 s after SIGTERM", left, "", None, "must be 0"),
    ]


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
