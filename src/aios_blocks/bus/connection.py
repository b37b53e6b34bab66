"""Connecting to NATS: the options a URL and the settings give (user inbox, TLS, credentials),
the reply-subject guard, the permission denials this process was told of, and ``connect``."""

from __future__ import annotations

import collections
import math
import ssl
from typing import TypedDict
from urllib.parse import urlsplit

import nats
import structlog
from nats.aio.client import Client

from ..settings import Settings
from ..settings import current as current_settings
from ..urls import mask

log = structlog.get_logger("aios.bus")


class SecurityOptions(TypedDict, total=False):
    """``nats.connect`` keyword arguments ``security_options`` sets (each only when it applies)."""

    inbox_prefix: str
    tls: ssl.SSLContext
    #: a ``.creds`` file
    user_credentials: str


def security_options(url: str, ca: str | None = None, settings: Settings | None = None) -> SecurityOptions:
    """Connection options from the URL and the settings (docs/security.md):

    * a user in the URL (``nats://user:pass@host``) gets the private reply prefix ``_INBOX.<user>``
      (the embedded server lets each user subscribe to its own inbox only);
    * ``ca`` or ``AIOS_NATS_CA``: CA file to verify a ``tls://`` server (the embedded self-signed
      certificate);
    * ``AIOS_NATS_CREDS``: a NATS ``.creds`` file (JWT + nkey seed) for operator-mode servers.
    """
    s = settings or current_settings()
    opts: SecurityOptions = {}
    first = urlsplit(url.split(",")[0].strip())
    if first.username:
        opts["inbox_prefix"] = f"_INBOX.{first.username}"
    if ca := ca or s.nats_ca:
        opts["tls"] = ssl.create_default_context(cafile=ca)
    if creds := s.nats_creds:
        opts["user_credentials"] = creds
    return opts


#: the prefix of every requester's reply subjects (each user's own: ``_INBOX.<user>``)
INBOX_PREFIX = "_INBOX."


def may_reply(reply: str) -> bool:
    """Whether a responder may publish its answer to ``reply``: only to an inbox. A responder's
    user publishes its answers through ``allow_responses``, which NATS grants for *any* reply
    subject a requester names; a requester that named a stored subject (``aios.block.B.ready``)
    or a KV key (``$KV.aios-instances.B``) would have the responder write it for them, forging
    events or state it may not publish itself (docs/security.md)."""
    return reply.startswith(INBOX_PREFIX)


#: the permission violations the server reported to this process's connections, latest last: a
#: request the server refused is never answered, so its caller sees only a timeout; a command
#: line tool says which permission was missing instead (``recent_denials``)
_DENIED: collections.deque[str] = collections.deque(maxlen=8)


def recent_denials() -> list[str]:
    """The latest permission violations reported to this process's connections."""
    return list(_DENIED)


def inbox_hint(denial: str) -> str:
    """What to set when the server refused a subscription to a reply inbox ("" for any other
    denial): every answer (a PubAck, a reply) comes to the client's inbox, and each user may read
    only its own ``_INBOX.<user>.>``, so a client left on the default ``_INBOX.`` prefix sees a
    permissions violation, and then a timeout, for a publish that was stored."""
    low = denial.lower()
    if "subscription" not in low or "_inbox." not in low:
        return ""
    return ("answers (PubAcks, replies) come to the client's inbox and each NATS user may read only its own: connect "
            "with the inbox prefix _INBOX.<user> (a URL with the user name sets it; nats-py inbox_prefix=, nats.js "
            "inboxPrefix, nats CLI --inbox-prefix, Go nats.CustomInboxPrefix). The publish itself may have been "
            "stored: retry it with the same Nats-Msg-Id")


class Unreachable(ConnectionError):
    """The first connection to a server could not be made in the time given (``first_wait_s``)."""


#: the pause between two connection attempts (first connection and reconnections)
RECONNECT_WAIT_S = 0.5


#: what a server says when it refuses a connection, before it closes it: the credentials
#: (``Authorization Violation``), or a connection limit, an account's (a tenant's share: its
#: ``max_connections``) or the server's
REFUSALS = ("authorization", "maximum account active connections exceeded", "maximum connections exceeded")

#: said after a connection limit's refusal: which limit, and what to do
LIMIT_HINT = ("every connection the account may have is in use; a tenant's limit is the tenant's, split across its "
              "users (`blocks tenant get T` shows each user's share): close one of them, or raise it with "
              "`blocks tenant add T --max-connections N`")


def why_not_connected(errors: list[str], exc: BaseException) -> str:
    """What to say of a first connection that failed: the server's refusal (of the credentials,
    ``Authorization Violation``, or for a connection limit) when any attempt got it, as the cause
    (the server closes the connection after it, so a later attempt's error is often only
    ``Connection reset by peer``), with what to do about a limit; else the last attempt's error,
    else the exception's."""
    refused = [e for e in errors if any(r in e.lower() for r in REFUSALS)]
    if refused:
        return refused[-1] if "authorization" in refused[-1].lower() else f"{refused[-1]}: {LIMIT_HINT}"
    return errors[-1] if errors else (str(exc) or type(exc).__name__)


async def connect(url: str, name: str = "aios", ca: str | None = None, settings: Settings | None = None,
                  first_wait_s: float | None = None) -> Client:
    """A connection that, once made, reconnects for ever (a server restart is waited out).
    ``first_wait_s``: give up the *first* connection after about that long and raise
    :class:`Unreachable` (a command line tool; nats-py's own default of "for ever" applies to the
    first connection too, and a CLI pointed at a wrong address would hang). ``None``: wait for
    the first connection for ever too (a worker or agent started before its server)."""
    errors: list[str] = []
    #: a command's connection that lost its server: the error said once, not at every attempt
    #: (twice a second: a `blocks watch` left open over a `blocks down` filled its terminal)
    said: list[str] = []

    async def error_cb(exc: Exception) -> None:
        if first_wait_s is not None and not connected:  # the caller is told why, once, below
            errors.append(str(exc) or type(exc).__name__)
            return
        if "permissions violation" in str(exc).lower():
            _DENIED.append(str(exc))
        elif first_wait_s is not None:
            if str(exc) in said:
                return
            said.append(str(exc))
            log.warning("nats.error", error=str(exc), note="reconnecting until the server is back; said once")
            return
        log.warning("nats.error", error=str(exc))  # permission violations land here too

    async def reconnected_cb() -> None:
        if said or first_wait_s is None:  # a command's connection that said it lost its server; a process's always
            said.clear()
            now = made[0].connected_url if made else None  # which of the servers it is back on
            log.warning("nats.reconnected", url=mask(url), server=mask(now.geturl()) if now else "")

    async def disconnected_cb() -> None:
        # a process's connection lost its server (not its own close: nats-py calls this then too);
        # a command's is said once by error_cb
        if first_wait_s is None and made and made[0].is_reconnecting:
            log.warning("nats.disconnected", url=mask(url), note="reconnecting until the server is back")

    made: list[Client] = []
    connected = False
    attempts = -1 if first_wait_s is None else max(1, math.ceil(first_wait_s / RECONNECT_WAIT_S))
    try:
        nc = await nats.connect(
            servers=url.split(","),
            name=name,
            error_cb=error_cb,
            reconnected_cb=reconnected_cb,
            disconnected_cb=disconnected_cb,
            max_reconnect_attempts=attempts,
            reconnect_time_wait=RECONNECT_WAIT_S,
            connect_timeout=5 if first_wait_s is None else max(0.5, min(5.0, first_wait_s)),
            pending_size=64 * 1024 * 1024,
            **security_options(url, ca, settings),
        )
    except Exception as exc:
        if first_wait_s is None:
            raise
        why = why_not_connected(errors, exc)
        raise Unreachable(f"cannot connect to NATS at {mask(url)} (tried for {first_wait_s:g}s): {why}") from exc
    connected = True
    made.append(nc)
    nc.options["max_reconnect_attempts"] = -1  # read at each reconnection: from now on, for ever
    return nc
