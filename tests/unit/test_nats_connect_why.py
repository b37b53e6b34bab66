"""What a command says of a first NATS connection that failed (``bus.connection.why_not_connected``):
with wrong credentials the server answers ``Authorization Violation`` and closes the connection,
so later attempts often end in ``Connection reset by peer``; the refusal is the cause to say
(``blocks submit -c`` with a wrong password: "the server refused the credentials", not "cannot
reach the servers"; test_tenant_submit failed so once in a suite run)."""

from __future__ import annotations

from aios_blocks.bus.connection import why_not_connected


def test_a_refusal_of_the_credentials_is_the_cause_whatever_came_after_it() -> None:
    errors = ["nats: 'Authorization Violation'", "[Errno 104] Connection reset by peer"]
    assert why_not_connected(errors, ConnectionResetError()) == "nats: 'Authorization Violation'"


def test_else_the_last_attempts_error_or_the_exceptions() -> None:
    assert why_not_connected(["[Errno 111] Connect call failed", "[Errno 104] Connection reset by peer"],
                             OSError()) == "[Errno 104] Connection reset by peer"
    assert why_not_connected([], TimeoutError("timed out")) == "timed out"
    assert why_not_connected([], TimeoutError()) == "TimeoutError"


def test_a_connection_limits_refusal_is_the_cause_with_what_to_do() -> None:
    # a tenant whose connections are all in use: the server says so and closes the connection, the
    # next attempts end in a reset, and the command said only "Connection reset by peer"
    errors = ["nats: 'maximum account active connections exceeded'", "[Errno 104] Connection reset by peer"]
    why = why_not_connected(errors, ConnectionResetError())
    assert why.startswith("nats: 'maximum account active connections exceeded': every connection the account may have")
    assert "blocks tenant add T --max-connections N" in why and "blocks tenant get T" in why
    assert "blocks tenant add" in why_not_connected(["nats: 'maximum connections exceeded'"], OSError())
