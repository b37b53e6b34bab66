"""Observers' rights on ``AIOS_OBSERVE``, their mirror of ``AIOS`` (docs/security.md): every consumer
kind there, the unnamed create included, which stays refused on the workers' stream; no worker
role touches the mirror, and only the admin creates, changes or removes it."""

from __future__ import annotations

import pytest

from aios_blocks.bus import subjects
from aios_blocks.runtime import auth

JS = "$JS.API"
OB = subjects.STREAM_OBSERVE
ST = subjects.STREAM


def allowed(role: str, subject: str, protected: tuple[str, ...] = ()) -> bool:
    perms = auth.permissions(role, "n1" if role == "agent" else None, protected=protected)
    if perms is None:
        return True
    return (any(subjects.matches(p, subject) for p in perms.publish)
            and not any(subjects.matches(p, subject) for p in perms.deny_publish))


def test_observers_have_every_consumer_kind_on_the_mirror() -> None:
    for api in (f"{JS}.CONSUMER.CREATE.{OB}",  # unnamed: nats.js ordered and ephemeral consumers
                f"{JS}.CONSUMER.CREATE.{OB}.oc_x_1", f"{JS}.CONSUMER.CREATE.{OB}.oc_x_1.aios.block.b.>",
                f"{JS}.CONSUMER.DURABLE.CREATE.{OB}.dash", f"{JS}.CONSUMER.INFO.{OB}.dash",
                f"{JS}.CONSUMER.MSG.NEXT.{OB}.dash", f"{JS}.CONSUMER.DELETE.{OB}.dash", f"{JS}.CONSUMER.NAMES.{OB}",
                f"{JS}.CONSUMER.LIST.{OB}", f"$JS.ACK.{OB}.dash.1.2.3.4.5", f"{JS}.STREAM.INFO.{OB}",
                f"{JS}.STREAM.MSG.GET.{OB}", "$JS.FC.x.y"):
        assert allowed("observer", api), api
    # the workers' consumers are named on AIOS only: the same names on the mirror are the observers'
    assert allowed("observer", f"{JS}.CONSUMER.MSG.NEXT.{OB}.parser")


def test_on_the_workers_stream_the_unnamed_create_stays_refused() -> None:
    assert not allowed("observer", f"{JS}.CONSUMER.CREATE.{ST}")
    for d in (*auth.WORKER_DURABLES, "agent-n7"):
        for api in (f"{JS}.CONSUMER.CREATE.{ST}.{d}", f"{JS}.CONSUMER.MSG.NEXT.{ST}.{d}", f"{JS}.CONSUMER.DELETE.{ST}.{d}",
                    f"$JS.ACK.{ST}.{d}.1.2.3.4.5"):
            assert not allowed("observer", api, protected=("agent-n7",)), api


@pytest.mark.parametrize("role", [r for r in auth.ROLES if r != "admin"] + ["agent"])
def test_only_the_admin_makes_or_changes_the_mirror_and_only_observers_consume_it(role: str) -> None:
    for op in ("CREATE", "UPDATE", "DELETE", "PURGE"):
        assert not allowed(role, f"{JS}.STREAM.{op}.{OB}"), (role, op)
    if role != "observer":
        for api in (f"{JS}.CONSUMER.CREATE.{OB}", f"{JS}.CONSUMER.CREATE.{OB}.x", f"{JS}.CONSUMER.MSG.NEXT.{OB}.x"):
            assert not allowed(role, api), (role, api)
    assert allowed("admin", f"{JS}.STREAM.CREATE.{OB}")
