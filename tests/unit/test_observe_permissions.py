"""Observers' rights on ``AIOS_OBSERVE``, their mirror of ``AIOS``, and on ``AIOS`` (docs/security.md
"Observers: a user each"): every consumer kind, under the names of their own user only (no
unnamed create, no listing); no worker role touches the mirror, and only the admin creates,
changes or removes it."""

from __future__ import annotations

import pytest

from aios_blocks.bus import subjects
from aios_blocks.runtime import auth
from aios_blocks.runtime.observers import observer_permissions, observer_user
from aios_blocks.schemas.roles import OBSERVER_CONSUMERS, observer_consumers

JS = "$JS.API"
OB = subjects.STREAM_OBSERVE
ST = subjects.STREAM


def allowed(role: str, subject: str, protected: tuple[str, ...] = ()) -> bool:
    perms = auth.permissions(role, "n1" if role == "agent" else None, protected=protected)
    if perms is None:
        return True
    return (any(subjects.matches(p, subject) for p in perms.publish)
            and not any(subjects.matches(p, subject) for p in perms.deny_publish))


def test_an_observer_has_every_consumer_kind_under_its_own_names_only() -> None:
    mine, other = "observer_3", "observer-dash_3"
    for st in (OB, ST):
        for name, ok in ((mine, True), (other, False), ("dash", False), ("oc_x_1", False), ("parser", False)):
            for api in (f"{JS}.CONSUMER.CREATE.{st}.{name}", f"{JS}.CONSUMER.CREATE.{st}.{name}.aios.block.b.>",
                        f"{JS}.CONSUMER.DURABLE.CREATE.{st}.{name}", f"{JS}.CONSUMER.MSG.NEXT.{st}.{name}",
                        f"{JS}.CONSUMER.DELETE.{st}.{name}", f"$JS.ACK.{st}.{name}.1.2.3.4.5", f"$JS.FC.{st}.{name}.x"):
                assert allowed("observer", api) is ok, api
        assert allowed("observer", f"{JS}.CONSUMER.INFO.{st}.{mine}")
        assert not allowed("observer", f"{JS}.CONSUMER.INFO.{st}.{other}")
        # the unnamed create names its consumer in the body (nats-server applies it to any consumer
        # of that name), and a list shows every consumer's state: both refused
        for api in (f"{JS}.CONSUMER.CREATE.{st}", f"{JS}.CONSUMER.NAMES.{st}", f"{JS}.CONSUMER.LIST.{st}"):
            assert not allowed("observer", api), api
        assert allowed("observer", f"{JS}.STREAM.INFO.{st}") and allowed("observer", f"{JS}.STREAM.MSG.GET.{st}")
    names = observer_consumers("observer")
    assert len(names) == OBSERVER_CONSUMERS and names[0] == "observer_1"
    assert not allowed("observer", f"{JS}.CONSUMER.CREATE.{OB}.observer_{OBSERVER_CONSUMERS + 1}")


def test_an_added_observers_user_has_the_same_rights_under_its_own_names() -> None:
    perms = observer_permissions(observer_user("dash"))
    can = lambda subject: any(subjects.matches(p, subject) for p in perms.publish)  # noqa: E731
    assert can(f"{JS}.CONSUMER.DELETE.{OB}.observer-dash_1") and can(f"{JS}.CONSUMER.MSG.NEXT.{ST}.observer-dash_32")
    assert not can(f"{JS}.CONSUMER.DELETE.{OB}.observer_1") and not can(f"{JS}.CONSUMER.DELETE.{OB}.observer-dash2_1")
    assert perms.subscribe[0] == "_INBOX.observer-dash.>" and set(auth.TASK_DATA) <= set(perms.deny_subscribe)
    with pytest.raises(ValueError):
        observer_user("a.b")


def test_on_the_workers_stream_an_observer_reads_the_workers_consumers_info_only() -> None:
    for d in (*auth.WORKER_DURABLES, "agent-n7"):
        assert allowed("observer", f"{JS}.CONSUMER.INFO.{ST}.{d}", protected=("agent-n7",)), d
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
