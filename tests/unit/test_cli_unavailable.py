"""A ``blocks`` command that meets JetStream's 503 ("JetStream system temporarily unavailable",
a leader election under way: soak finding, docs/reliability.md) says it cannot reach the servers
in one line and exits 2, as for a server it cannot connect to: not a traceback with exit 1, which
reads as a refusal or, for ``blocks check``, as an invariant violation."""

from __future__ import annotations

import pytest
import typer
from nats.js.errors import APIError, ServiceUnavailableError

from aios_blocks.cli.common import _run


async def _unavailable() -> None:
    raise ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable")


async def _refused() -> None:
    raise APIError(code=400, err_code=10058, description="stream name already in use")


def test_jetstream_unavailable_is_exit_2_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as ex:
        _run(_unavailable())
    assert ex.value.exit_code == 2
    said = capsys.readouterr().err
    assert "Cannot reach the servers" in said and "temporarily unavailable" in said and "Traceback" not in said


def test_other_jetstream_errors_are_not_hidden() -> None:
    with pytest.raises(APIError):
        _run(_refused())


async def _wrong_type() -> None:
    from redis.exceptions import ResponseError

    raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")


def test_a_command_redis_refuses_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    # `blocks get B` / `blocks explain B` with B's record key of another type printed a rich
    # traceback (`blocks list` said it in one line)
    with pytest.raises(typer.Exit) as ex:
        _run(_wrong_type())
    assert ex.value.exit_code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "Redis refused a command: WRONGTYPE" in said and "blocks recover --force" in said and "Traceback" not in said
