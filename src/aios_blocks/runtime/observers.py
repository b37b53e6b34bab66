"""Observers: a NATS user each (docs/security.md "Observers: a user each").

Observers (dashboards, people, auditors, the web console) read every event but task data. They
used to share the one user ``observer``, and NATS cannot tell one holder of a password from
another: any observer could delete, update, read the state of or pull from any other observer's
consumer (on ``AIOS`` and on the observers' mirror ``AIOS_OBSERVE``) and so suppress the events
another dashboard sees. Now each observer is a user of its own: the data dir's ``observer`` (the
console and ``blocks`` read commands next to ``blocks up``) and ``observer-<name>`` for each client
given its own credentials (``blocks observer add NAME``). A user may touch only the consumers named
after it, ``<user>_1`` .. ``<user>_<OBSERVER_CONSUMERS>`` (``schemas.roles.observer_consumers``):
NATS permissions have no prefix wildcards, so each name is listed, on both streams. The unnamed
create (``CONSUMER.CREATE.<stream>``) is refused: it names its consumer in the body, which
permissions cannot see, and nats-server 2.15 then updates any consumer of that name. Listing
consumers is refused too (it shows the others' state); each user reads its replies on its own
inbox ``_INBOX.<user>``, so no observer reads another's deliveries.

Users are config-file users with passwords, added with a config reload as node agents are
(``auth.ensure_agent``); the password is kept in the secrets file and in the observer's
credentials file ``<data dir>/observers/<name>.json`` (0600).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..bus import subjects
from ..schemas.roles import OBSERVER, observer_consumers
from ..schemas.spec import ID_RE
from .auth import (
    INTAKE_INFO,
    JS,
    OUTPUTS_INFO,
    STREAM_INFO,
    TASK_DATA,
    WORKER_DURABLES,
    Endpoints,
    Permissions,
    Secrets,
    _token,
    inbox_prefix,
    locked,
    reload_and_wait,
    secured_endpoints,
    wait_nats_user,
    with_userinfo,
    write_private,
)


def observer_user(name: str) -> str:
    """The NATS user of the observer ``name`` (``blocks observer add NAME``)."""
    if not isinstance(name, str) or not ID_RE.match(name):
        raise ValueError(f"invalid observer name {name!r}: must match {ID_RE.pattern}")
    return f"{OBSERVER}-{name}"


def consumer_rights(user: str, stream: str) -> list[str]:
    """Create (named: with or without the filter in the subject; legacy durable), info, pull, ack,
    flow control replies and delete of ``user``'s own consumer names on ``stream``, and nothing else."""
    rights = []
    for n in observer_consumers(user):
        rights += [f"{JS}.CONSUMER.CREATE.{stream}.{n}", f"{JS}.CONSUMER.CREATE.{stream}.{n}.>",
                   f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.{n}", f"{JS}.CONSUMER.INFO.{stream}.{n}",
                   f"{JS}.CONSUMER.MSG.NEXT.{stream}.{n}", f"{JS}.CONSUMER.DELETE.{stream}.{n}",
                   f"$JS.ACK.{stream}.{n}.>", f"$JS.FC.{stream}.{n}.>"]
    return rights


def observer_permissions(user: str = OBSERVER, protected: Iterable[str] = ()) -> Permissions:
    """An observer's rights: every event but task data (NATS refuses a subscription to
    ``TASK_DATA`` and filters it out of every wider one's deliveries), as no queue group's member
    (one that joined the controllers' would take their queries away); stream info and message
    gets of ``AIOS`` and ``AIOS_OBSERVE``; consumers of its own names only (module docstring).
    ``$JS.API.INFO`` (account info): the Node client's jetstreamManager() asks it first; on
    ``AIOS_INTAKE`` (the creates as sent) only the parser consumer's info, which ``ensure_topology``
    checks (each create is in ``AIOS`` as its ``submitted``); on ``AIOS`` the info of the workers'
    durables (``protected``: the node agents' and per-cluster controllers' so far), their backlog."""
    st, ob = subjects.STREAM, subjects.STREAM_OBSERVE
    allow = [f"{JS}.INFO", STREAM_INFO, OUTPUTS_INFO, INTAKE_INFO,
             f"{JS}.CONSUMER.INFO.{subjects.PARSER.stream}.{subjects.PARSER.durable}", f"{JS}.STREAM.NAMES",
             f"{JS}.STREAM.MSG.GET.{st}", f"{JS}.STREAM.INFO.{ob}", f"{JS}.STREAM.MSG.GET.{ob}",
             *consumer_rights(user, st), *consumer_rights(user, ob),
             *(f"{JS}.CONSUMER.INFO.{st}.{d}" for d in sorted({*WORKER_DURABLES, *protected}))]
    return Permissions(tuple(allow), (f"{inbox_prefix(user)}.>", f"{subjects.ROOT}.>"),
                       deny_subscribe=(f"{subjects.ROOT}.> *", *TASK_DATA))


def conf_lines(s: Secrets, protected: Iterable[str]) -> list[str]:
    """nats.conf's user entries of the observers added with ``blocks observer add``."""
    protected = tuple(protected)
    return [f"      {{user: {json.dumps(observer_user(name))}, password: {json.dumps(pw)}, "
            f"permissions: {observer_permissions(observer_user(name), protected).conf()}}}" for name, pw in sorted(s.observers.items())]


def credentials_path(data_dir: Path, name: str) -> Path:
    observer_user(name)  # validates
    return Path(data_dir).resolve() / "observers" / f"{name}.json"


def credentials(ep: Endpoints, name: str, password: str) -> dict[str, Any]:
    """What an observer's client needs (the credentials file, JSON, 0600): the NATS URL with its
    user and password, its inbox prefix and consumer names, the read-only Redis URL (shared: reads
    take nothing from anyone), the CA of a TLS server."""
    user = observer_user(name)
    names = observer_consumers(user)
    return {"observer": name, "user": user, "password": password, "url": ep.nats, "nats_url": with_userinfo(ep.nats, user, password),
            "inbox_prefix": inbox_prefix(user), "consumers": f"{names[0]} .. {names[-1]}",
            "redis_url": ep.redis_url(OBSERVER), **({"ca": ep.nats_ca} if ep.nats_ca else {})}


def add_observer(data_dir: Path, name: str, timeout: float = 10.0) -> tuple[bool, Path]:
    """Make the observer ``name``'s user on the running embedded server (config rewrite + reload),
    or keep an existing one; (whether it is new, its credentials file)."""
    ep = secured_endpoints(data_dir, "observers")
    user = observer_user(name)
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        new = name not in s.observers
        if new:
            s.observers[name] = _token()
            s.save()
            reload_and_wait(ep.data_dir, s, timeout)
        path = credentials_path(ep.data_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        write_private(path, json.dumps(credentials(ep, name, s.observers[name]), indent=1) + "\n")
    wait_nats_user(with_userinfo(ep.nats, user, s.observers[name]), ep.nats_ca, timeout)
    return new, path


def remove_observer(data_dir: Path, name: str, timeout: float = 10.0) -> bool:
    """Remove the observer's user (the reload closes its connections) and credentials file; its
    consumers are deleted by ``blocks observer remove`` (the admin's right)."""
    ep = secured_endpoints(data_dir, "observers")
    observer_user(name)
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        if s.observers.pop(name, None) is None:
            return False
        s.save()
        reload_and_wait(ep.data_dir, s, timeout)
    with contextlib.suppress(FileNotFoundError):
        credentials_path(ep.data_dir, name).unlink()
    return True


def observers(data_dir: Path) -> list[dict[str, str]]:
    """Every observer added: name, NATS user, credentials file (no password)."""
    s = Secrets.load(Path(data_dir).resolve(), create=False)
    return [{"observer": n, "user": observer_user(n), "credentials": str(credentials_path(data_dir, n))} for n in sorted(s.observers)]
