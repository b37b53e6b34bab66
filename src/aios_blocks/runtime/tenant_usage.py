"""Whether a tenant's accounts fit their shares of its limits before a new split is written
(docs/security.md "Per-tenant limits"; ``runtime.tenants.shares``).

A split is redone when a user is added (every share shrinks) or the limits change. nats-server
closes an account's connections beyond its new ``max_connections``, but keeps the streams and
consumers an account already has when its JetStream limits shrink below them: with a new user's
share beside them, the tenant's accounts together would hold more than its figure. So before such
a split each existing account's JetStream use is read (``$JS.API.INFO``, logged in as its user)
and the split is refused when one holds more than its new share, saying which and what to do.
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


def account_info(url: str, ca: str | None, timeout: float = 5.0) -> dict[str, Any]:
    """The JetStream use of the account of the URL's user: one synchronous request on the NATS
    protocol (as ``auth.nats_login``), so it can be called under the secrets lock from any caller."""
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
        sock.sendall(b"CONNECT " + json.dumps(opts).encode() + f"\r\nSUB {_INBOX} 1\r\nPUB $JS.API.INFO {_INBOX} 0\r\n\r\n"
                     .encode())
        while line := f.readline():
            if line.startswith(b"MSG "):
                size = int(line.split()[-1])
                return dict(json.loads(f.read(size + 2)[:size]))
            if line.startswith(b"PING"):
                sock.sendall(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                raise RuntimeError(f"nats-server refused {parts.username!r}: {line.decode().strip()}")
    raise RuntimeError(f"nats-server closed the connection of {parts.username!r} before answering")


def shrunk(new: tn.Tenant, old: tn.Tenant) -> list[str]:
    """The users of both whose account's JetStream share is smaller in ``new`` than in ``old``."""
    before, after = tn.shares(old), tn.shares(new)
    return [u for u in tn.ordered(list(after)) if u in before and any(after[u][n] < before[u][n] for n in USE)]


def _use(t: tn.Tenant, user: str, nats_url: str, ca: str | None) -> dict[str, Any]:
    try:
        got = account_info(with_userinfo(nats_url, tn.user_name(t.name, user), t.users[user]), ca)
    except RuntimeError as exc:
        if "maximum account active connections" not in str(exc):
            raise
        n, flag = len(t.users), tn.SPLIT["connections"]
        raise ValueError(f"tenant {t.name!r}: account {tn.account(t.name, user)} uses every connection of its share, so "
                         f"its JetStream use cannot be read to check the new split: try again once one closes, or first "
                         f"raise {flag} by {n - 1} (one more for each account it has now), then again") from None
    if "error" in got:
        raise RuntimeError(f"account {tn.account(t.name, user)}: no JetStream use: {got['error']}")
    return got


def over(new: tn.Tenant, old: tn.Tenant, nats_url: str, ca: str | None) -> str | None:
    """Why ``new``'s split (a tenant's users and limits as they would be) does not fit what the
    accounts it already has (``old``'s) hold, or ``None``. Only accounts whose JetStream share
    shrinks are read (``shrunk``): raising a limit logs in as nobody."""
    split = tn.shares(new)
    for user in shrunk(new, old):
        got = _use(new, user, nats_url, ca)
        for name, keys in USE.items():
            held, share = max(int(got.get(k) or 0) for k in keys), split[user][name]
            if held > share:
                flag = tn.SPLIT[name]
                return (f"tenant {new.name!r}: account {tn.account(new.name, user)} (user {tn.user_name(new.name, user)}) "
                        f"holds {held} {name.replace('_', ' ')} in its JetStream, more than its share {share} of {flag} "
                        f"{getattr(new.limits, name)} split across {len(split)} users: it would keep them, and its users "
                        f"together hold more than the tenant's limit; raise {flag} or make its streams smaller or fewer first")
    return None


def check(new: tn.Tenant, old: tn.Tenant, nats_url: str, ca: str | None) -> tn.Tenant:
    """``new``, or ValueError: its limits do not split across its users (``tenants.unfit``), or an
    account it has already holds more than its new share (``over``)."""
    tn.check(new)
    if (why := over(new, old, nats_url, ca)) is not None:
        raise ValueError(why)
    return new
