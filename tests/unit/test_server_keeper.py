"""The decisions of ``runtime.server_keeper``: when a dead embedded server is started again, and
when `blocks up` gives up (the real servers: tests/integration/test_up_server_restart.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from aios_blocks.runtime.server_keeper import Backoff, ServerKeeper, ServersGiveUp, exited, next_start


def test_a_first_death_restarts_at_once_then_the_pause_doubles_up_to_its_cap_and_gives_up() -> None:
    p = Backoff(window_s=60, max_deaths=5, first_pause_s=0.5, max_pause_s=1.0)
    assert next_start([100.0], 100.0, p) == 0.0
    assert next_start([99.0, 100.0], 100.0, p) == 0.5
    assert next_start([98.0, 99.0, 100.0], 100.0, p) == 1.0
    assert next_start([97.0, 98.0, 99.0, 100.0], 100.0, p) == 1.0  # capped
    assert next_start([96.0, 97.0, 98.0, 99.0, 100.0], 100.0, p) is None
    # deaths older than the window do not count: a server that died now and then is always restarted
    assert next_start([1.0, 2.0, 3.0, 4.0, 100.0], 100.0, p) == 0.0


def test_exit_status_in_words() -> None:
    assert exited(-9) == "signal SIGKILL"
    assert exited(1) == "code 1"


@dataclass
class FakeServers:
    data_dir: Path
    nats_port: int = 4222
    redis_port: int = 6379
    deaths: list[list[tuple[str, int, int]]] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    fail: bool = False

    def dead(self) -> list[tuple[str, int, int]]:
        return self.deaths.pop(0) if self.deaths else []

    def start_again(self, program: str) -> None:
        self.started.append(program)
        if self.fail:
            raise RuntimeError(f"{program} exited with 1")


def _keeper(servers: FakeServers, said: list[str], clock: list[float]) -> ServerKeeper:
    return ServerKeeper(servers, Backoff(window_s=60, max_deaths=3), say=said.append, clock=lambda: clock[0],
                        sleep=lambda s: clock.__setitem__(0, clock[0] + s))


def test_the_keeper_restarts_says_which_server_how_and_where_its_log_is_and_gives_up_after_quick_deaths(tmp_path: Path) -> None:
    servers, said, clock = FakeServers(tmp_path), [], [10.0]
    keeper = _keeper(servers, said, clock)
    keeper.check()
    assert servers.started == [] and said == []
    servers.deaths = [[("nats-server", 41, -9), ("redis-server", 42, 1)]]
    keeper.check()
    assert servers.started == ["nats-server", "redis-server"]
    assert said[0] == (f"nats-server (pid 41, port 4222) exited with signal SIGKILL (its log: {tmp_path / 'nats.log'}); "
                       "started again on port 4222, same config and data (restart 1)")
    assert "redis-server (pid 42, port 6379) exited with code 1" in said[1] and str(tmp_path / "redis.log") in said[1]
    assert "exited with signal SIGKILL; starting it again" in (tmp_path / "nats.log").read_text()
    servers.deaths = [[("nats-server", 43, -9)], [("nats-server", 44, -9)]]
    keeper.check()
    assert clock[0] == 10.5  # the second quick death: a pause first
    with pytest.raises(ServersGiveUp, match=r"nats-server \(pid 44, port 4222\) exited with signal SIGKILL; it died 3 times within 60 s: not started again"):
        keeper.check()
    assert servers.started.count("nats-server") == 2
    assert "not started again" in (tmp_path / "nats.log").read_text()


def test_a_start_that_fails_is_said_and_counted_at_the_next_look(tmp_path: Path) -> None:
    servers, said, clock = FakeServers(tmp_path, fail=True), [], [0.0]
    keeper = _keeper(servers, said, clock)
    servers.deaths = [[("redis-server", 7, -9)]]
    keeper.check()
    assert said == ["redis-server could not be started again (restart 1): redis-server exited with 1"]
