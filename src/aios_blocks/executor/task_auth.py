"""Credentials on the executors' HTTP port (docs/security.md "The executors' HTTP port").

With ``AIOS_EXECUTOR_HTTP_USERS`` naming a users file (``runtime.task_users``: ``blocks up`` names
its own when auth is on), every ``/blocks/{bid}/...`` request needs HTTP Basic credentials of a user
who may send block ``bid`` a task over NATS: ``upstream``, ``admin``, or one of the block's tenant's
users. Missing or wrong: 401 (``WWW-Authenticate: Basic realm="aios-blocks"``); a tenant's user for
a block that is not its tenant's (or no block at all: 403 alike, so nothing tells which blocks
exist): 403. ``/health`` stays open. The file is read again when its stat changes (tenant users
added or removed), one ``os.stat`` per request. Passwords are compared as their salted hashes in
constant time (``hmac.compare_digest``) and never logged or echoed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from ..runtime.task_users import VERSION, digest
from .engine import Refused

log = structlog.get_logger("aios.executor")

REALM = "aios-blocks"
#: the header of every 401 (RFC 7617)
CHALLENGE = {"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'}


@dataclass(frozen=True)
class User:
    name: str
    salt: bytes
    sha256: str
    #: a tenant's user: that tenant's blocks only; None: any block (``upstream``, ``admin``)
    tenant: str | None = None


def parse_users(doc: object) -> dict[str, User]:
    """The users of a task-users file's JSON (``runtime.task_users``); entries that are not
    well formed are left out (they can never match)."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("users"), dict):
        raise ValueError(f"not a task-users file of version {VERSION}")
    out = {}
    for name, e in doc["users"].items():
        try:
            tenant = e.get("tenant")
            out[str(name)] = User(str(name), bytes.fromhex(e["salt"]), str(e["sha256"]), str(tenant) if tenant else None)
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
    return out


def basic(header: str | None) -> tuple[str, str] | None:
    """(user, password) of an ``Authorization: Basic ...`` header; None when there is none or it is
    not one."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        text = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    user, sep, password = text.partition(":")
    return (user, password) if sep else None


#: compared against when the user is unknown, so an unknown name costs what a known one does
_NOBODY = User("", b"\0" * 16, "0" * 64)


def authenticate(users: Mapping[str, User], header: str | None) -> User | Refused:
    """The user a request's credentials name, or its 401 (the reason never holds the password)."""
    creds = basic(header)
    if creds is None:
        return Refused(401, "credentials required: HTTP Basic of a user that may send this block tasks over NATS "
                            "(upstream, admin, or a user of the block's tenant)")
    name, password = creds
    user = users.get(name)
    ok = hmac.compare_digest(digest((user or _NOBODY).salt, password), (user or _NOBODY).sha256)
    if user is None or not ok:
        return Refused(401, "wrong user name or password")
    return user


def authorize(user: User, bid: str, block_tenant: str | None) -> Refused | None:
    """Whether ``user`` may send block ``bid`` (whose tenant is ``block_tenant``; None: the default
    tenant's, or no such block) a task: as over NATS, a tenant's user only its own tenant's blocks."""
    if user.tenant is None or user.tenant == block_tenant:
        return None
    return Refused(403, f"user {user.name!r} may send tasks only to the blocks of tenant {user.tenant!r}, "
                        f"and block {bid!r} is not one of them")


class TaskUsers:
    """The users file, read again whenever its stat (inode, size, mtime) changes; while it cannot
    be read (or is not one) nobody is let in."""

    def __init__(self, path: str):
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._users: dict[str, User] = {}

    def users(self) -> dict[str, User]:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            if self._key != (0, 0, 0):
                log.error("executor.task_users_unreadable", path=self.path, error=repr(exc))
            self._key, self._users = (0, 0, 0), {}
            return self._users
        if key != self._key:
            try:
                with open(self.path, "rb") as f:
                    self._users = parse_users(json.loads(f.read()))
                log.info("executor.task_users_loaded", path=self.path, users=len(self._users))
            except (OSError, ValueError) as exc:
                log.error("executor.task_users_unreadable", path=self.path, error=repr(exc))
                self._users = {}
            self._key = key
        return self._users
