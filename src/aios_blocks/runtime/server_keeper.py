"""`blocks up` keeps its embedded servers running, as the supervisor keeps its workers.

An embedded ``nats-server`` or ``redis-server`` that dies (a crash, ``kill -9``, the OOM killer)
is noticed at the next look (``ServerKeeper.check``, every 0.2 s from `blocks up`'s main thread:
a server started there dies with that thread, ``lifetime.die_with_parent``), said on `blocks up`'s
stderr and in the server's own log (which server, how it exited, where its log is), and started
again on the same port with the same config and data dir (``EmbeddedServers.start_nats`` /
``start_redis``): JetStream's file store and Redis' append-only file keep what they held, and the
workers' clients reconnect by themselves. A server that keeps dying is started again after a
growing pause (``next_start``); one that died ``max_deaths`` times within ``window_s`` is not:
``ServersGiveUp`` ends `blocks up` (exit 2), which stops everything it started.
Before this a dead server stayed dead, silently: the workers retried for ever and every command
failed.
"""

from __future__ import annotations

import datetime
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol


class Server(StrEnum):
    """An embedded server, by its program's name."""

    NATS = "nats-server"
    REDIS = "redis-server"


@dataclass(frozen=True)
class Backoff:
    """How a server that keeps dying is started again: at once after a first death, then after
    ``first_pause_s``, doubled each death after, at most ``max_pause_s``; given up at the
    ``max_deaths``-th death within ``window_s`` seconds."""

    window_s: float = 60.0
    max_deaths: int = 5
    first_pause_s: float = 0.5
    max_pause_s: float = 8.0


def next_start(deaths: list[float], now: float, policy: Backoff) -> float | None:
    """Seconds to wait before starting a server again that died at the times ``deaths`` (the last
    one now, monotonic seconds); ``None``: it died too often, give up."""
    recent = sum(1 for t in deaths if now - t <= policy.window_s)
    if recent >= policy.max_deaths:
        return None
    if recent <= 1:
        return 0.0
    return min(policy.max_pause_s, policy.first_pause_s * 2 ** (recent - 2))


def exited(code: int) -> str:
    """``signal SIGKILL`` for -9, ``code 1`` for 1."""
    if code < 0 and -code in signal.valid_signals():
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


class ServersGiveUp(RuntimeError):
    """An embedded server died too often to be started again."""


class Servers(Protocol):
    """What the keeper needs of ``EmbeddedServers``."""

    data_dir: Path
    nats_port: int
    redis_port: int

    def dead(self) -> list[tuple[str, int, int]]: ...

    def start_again(self, program: str) -> None: ...


@dataclass
class ServerKeeper:
    servers: Servers
    policy: Backoff = field(default_factory=Backoff)
    #: where the lines for a person go (`blocks up`'s stderr)
    say: Callable[[str], None] = field(default_factory=lambda: _stderr)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    #: program -> when it died (monotonic), within the policy's window
    deaths: dict[str, list[float]] = field(default_factory=dict)
    restarts: int = 0

    def log_of(self, program: str) -> Path:
        return self.servers.data_dir / ("nats.log" if program == Server.NATS else "redis.log")

    def port_of(self, program: str) -> int:
        return self.servers.nats_port if program == Server.NATS else self.servers.redis_port

    def check(self) -> None:
        """Start again every server that died since the last look; raises ``ServersGiveUp`` for
        one that died too often (the caller stops everything)."""
        for program, pid, code in self.servers.dead():
            now = self.clock()
            times = [t for t in self.deaths.get(program, []) if now - t <= self.policy.window_s] + [now]
            self.deaths[program] = times
            log, port = self.log_of(program), self.port_of(program)
            how = f"{program} (pid {pid}, port {port}) exited with {exited(code)}"
            pause = next_start(times, now, self.policy)
            if pause is None:
                why = f"{how}; it died {len(times)} times within {self.policy.window_s:g} s: not started again"
                self._note(log, why)
                raise ServersGiveUp(f"{why} (its log: {log}); stopping everything")
            self._note(log, f"{how}; starting it again on the same port, config and data dir"
                            + (f" in {pause:g} s" if pause else ""))
            self.sleep(pause)
            self.restarts += 1
            try:
                self.servers.start_again(program)
            except (RuntimeError, OSError) as exc:  # it exited at once, or never listened: the next look counts it
                self.say(f"{program} could not be started again (restart {self.restarts}): {exc}")
                continue
            self.say(f"{how} (its log: {log}); started again on port {port}, same config and data (restart {self.restarts})")

    def _note(self, log: Path, text: str) -> None:
        """A line in the server's own log (it appends there too; it is dead while we write)."""
        stamp = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
        try:
            with log.open("a") as f:
                f.write(f"{stamp} [blocks up] {text}\n")
        except OSError:
            pass


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
