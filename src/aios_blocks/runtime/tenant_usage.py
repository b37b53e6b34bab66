"""Whether a tenant's accounts fit their shares of its limits before a new split is written
(docs/security.md "Per-tenant limits"; ``runtime.tenants.shares``).

A split is redone when a user is added (every share shrinks) or the limits change. nats-server
closes an account's connections beyond its new ``max_connections``, but keeps the streams and
consumers an account already has when its JetStream limits shrink below them: with a new user's
share beside them, the tenant's accounts together would hold more than its figure. So before such
a split each existing account's JetStream use is read and the split is refused when one holds more
than its new share, saying which and what to do. It is read through the server's system account
(``$SYS.REQ.SERVER.PING.JSZ``, as ``tenants.MONITOR_USER``), not on a connection of the
account's own: an account using every connection of its share is read all the same (logged in as
its user, the read needed one more and the split was refused). A server whose config predates that
user (started before it, no tenant change since) is read as the account's user, as before.
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

from . import tenants as tn
from .locate import with_userinfo

#: what an account's JetStream holds (``$JS.API.INFO``), against which share (``tenants.SPLIT``)
USE = {"stream_bytes": ("reserved_storage", "storage"), "memory_bytes": ("reserved_memory", "memory"),
       "streams": ("streams",), "consumers": ("consumers",)}
_INBOX = "_INBOX.aios-usage"


def _request(url: str, ca: str | None, subject: str, body: bytes, inbox: str, timeout: float = 5.0) -> dict[str, Any]:
    """One synchronous request on the NATS protocol as the URL's user (as ``auth.nats_login``), so
    it can be made under the secrets lock from any caller: its answer's JSON."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=timeout) as raw:
        f = raw.makefile("rb")
        info = json.loads(f.readline().split(b" ", 1)[1])
        sock: socket.socket = raw
        if info.get("tls_required"):
            sock = ssl.create_default_context(cafile=ca).wrap_socket(raw, server_hostname=parts.hostname)
            f = sock.makefile("rb")
        opts = {"user": unquote(parts.username or ""), "pass": unquote(parts.password or ""), "verbose": False,
                "pedantic": False}
        sock.sendall(b"CONNECT " + json.dumps(opts).encode() + f"\r\nSUB {inbox} 1\r\nPUB {subject} {inbox} {len(body)}\r\n"
                     .encode() + body + b"\r\n")
        while line := f.readline():
            if line.startswith(b"MSG "):
                size = int(line.split()[-1])
                return dict(json.loads(f.read(size + 2)[:size]))
            if line.startswith(b"PING"):
                sock.sendall(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                raise RuntimeError(f"nats-server refused {parts.username!r}: {line.decode().strip()}")
    raise RuntimeError(f"nats-server closed the connection of {parts.username!r} before answering")


def account_info(url: str, ca: str | None, timeout: float = 5.0) -> dict[str, Any]:
    """The JetStream use of the account of the URL's user (``$JS.API.INFO``, on a connection of that
    account's: the way of a server without ``tenants.MONITOR_USER``)."""
    return _request(url, ca, "$JS.API.INFO", b"", _INBOX, timeout)


def account_jsz(url: str, account: str, ca: str | None, timeout: float = 5.0) -> dict[str, Any]:
    """The JetStream use of ``account``, asked of the server's system account as the URL's user
    (``tenants.MONITOR_USER``: no connection of the account's own; ``$SYS.REQ.SERVER.PING.JSZ``
    for that account, its streams with their config), in ``$JS.API.INFO``'s terms (``jsz_use``);
    ``{"error": ...}`` when the server has none for it."""
    ask = {"account": account, "accounts": True, "streams": True, "config": True}
    got = _request(url, ca, "$SYS.REQ.SERVER.PING.JSZ", json.dumps(ask).encode(), tn.MONITOR_INBOX, timeout)
    if got.get("error"):
        return {"error": (got.get("error") or {}).get("description") or str(got["error"])}
    found = [d for d in (got.get("data") or {}).get("account_details") or [] if d.get("name") == account]
    return jsz_use(found[0]) if found else {"error": "the server has no JetStream account by that name"}


def jsz_use(data: dict[str, Any]) -> dict[str, int]:
    """An account's JSZ (its ``account_details`` entry, with streams and config) as ``$JS.API.INFO``
    gives its use: bytes stored, bytes its streams reserve (``max_bytes``, by storage), streams,
    consumers. (The JSZ's own ``reserved_*`` are the account's limits, not what its streams reserve.)"""
    streams = data.get("stream_detail") or []
    reserved = {"file": 0, "memory": 0}
    for st in streams:
        config = st.get("config") or {}
        if (size := int(config.get("max_bytes") or 0)) > 0:
            reserved["memory" if config.get("storage") == "memory" else "file"] += size
    return {"storage": int(data.get("storage") or 0), "memory": int(data.get("memory") or 0),
            "reserved_storage": reserved["file"], "reserved_memory": reserved["memory"], "streams": len(streams),
            "consumers": sum(int((st.get("state") or {}).get("consumer_count") or 0) for st in streams)}


def shrunk(new: tn.Tenant, old: tn.Tenant) -> list[str]:
    """The users of both whose account's JetStream share is smaller in ``new`` than in ``old``."""
    before, after = tn.shares(old), tn.shares(new)
    return [u for u in tn.ordered(list(after)) if u in before and any(after[u][n] < before[u][n] for n in USE)]


def _use(t: tn.Tenant, user: str, nats_url: str, ca: str | None, monitor: str | None) -> dict[str, Any]:
    """The JetStream use of ``user``'s account: through the system account (``monitor``, the
    password of ``tenants.MONITOR_USER``), else (none, or a server that does not know that user
    yet) logged in as the account's user."""
    got: dict[str, Any] | None = None
    if monitor:
        try:
            got = account_jsz(with_userinfo(nats_url, tn.MONITOR_USER, monitor), tn.account(t.name, user), ca)
        except RuntimeError as exc:
            if "authorization violation" not in str(exc).lower():
                raise
    if got is None:
        got = _as_user(t, user, nats_url, ca)
    if "error" in got:
        raise RuntimeError(f"account {tn.account(t.name, user)}: no JetStream use: {got['error']}")
    return got


def _as_user(t: tn.Tenant, user: str, nats_url: str, ca: str | None) -> dict[str, Any]:
    try:
        return account_info(with_userinfo(nats_url, tn.user_name(t.name, user), t.users[user]), ca)
    except RuntimeError as exc:
        if "maximum account active connections" not in str(exc):
            raise
        n, flag = len(t.users), tn.SPLIT["connections"]
        raise ValueError(f"tenant {t.name!r}: account {tn.account(t.name, user)} uses every connection of its share, so "
                         f"its JetStream use cannot be read to check the new split: try again once one closes, or first "
                         f"raise {flag} by {n - 1} (one more for each account it has now), then again") from None


def over(new: tn.Tenant, old: tn.Tenant, nats_url: str, ca: str | None, monitor: str | None = None) -> str | None:
    """Why ``new``'s split (a tenant's users and limits as they would be) does not fit what the
    accounts it already has (``old``'s) hold, or ``None``. Only accounts whose JetStream share
    shrinks are read (``shrunk``; ``monitor``: as ``_use``): raising a limit reads nothing."""
    split = tn.shares(new)
    for user in shrunk(new, old):
        got = _use(new, user, nats_url, ca, monitor)
        for name, keys in USE.items():
            held, share = max(int(got.get(k) or 0) for k in keys), split[user][name]
            if held > share:
                flag = tn.SPLIT[name]
                return (f"tenant {new.name!r}: account {tn.account(new.name, user)} (user {tn.user_name(new.name, user)}) "
                        f"holds {held} {name.replace('_', ' ')} in its JetStream, more than its share {share} of {flag} "
                        f"{getattr(new.limits, name)} split across {len(split)} users: it would keep them, and its users "
                        f"together hold more than the tenant's limit; raise {flag} or make its streams smaller or fewer first")
    return None


def check(new: tn.Tenant, old: tn.Tenant, nats_url: str, ca: str | None, monitor: str | None = None) -> tn.Tenant:
    """``new``, or ValueError: its limits do not split across its users (``tenants.unfit``), or an
    account it has already holds more than its new share (``over``; ``monitor``: the password of
    ``tenants.MONITOR_USER``, which reads the accounts' use)."""
    tn.check(new)
    if (why := over(new, old, nats_url, ca, monitor)) is not None:
        raise ValueError(why)
    return new
