"""Who may send tasks over the executors' HTTP port (docs/security.md "The executors' HTTP port").

Over NATS the server decides: the ``upstream`` and ``admin`` roles may request
``aios.block.B.task``, and a tenant's users their own blocks' (through the gateway's tenant desk).
The executors' HTTP port asks for the same users with the same passwords (HTTP Basic), so it
needs to know them. It is given **hashes**, not the passwords: ``<data dir>/auth/task-users.json``
(0600), one salted SHA-256 per user that may send tasks, written beside ``secrets.json`` each time
that is saved (``auth.Secrets.save``: tenant users added or removed by any ``blocks tenant``
command) and when the embedded servers start (``sync``: a data dir made before it); the executor
re-reads it when its stat changes (``executor.task_auth``). An executor
process (the ``serve`` group, an executor on another host) then holds no password that would let
it log in to NATS as the admin or as a tenant. The passwords are random 192-bit tokens
(``auth._token``), so a fast salted hash is as safe as a slow one and costs about a microsecond
per task.

The file::

    {"version": 1, "users": {"upstream": {"salt": HEX, "sha256": HEX},
                             "admin": {...}, "<tenant>.<user>": {"salt", "sha256", "tenant": "<tenant>"}}}

A user with a ``tenant`` may send tasks only to that tenant's blocks (the block's ``tenant``
label, which the mapper copies into the block's instance map).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import tenants as tn

#: the file's name, beside ``secrets.json``
FILE = "task-users.json"
VERSION = 1
#: the system's roles that may send any block a task over NATS (``upstream``; the admin may do all)
TASK_ROLES = ("upstream", "admin")


def path(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / "auth" / FILE


def digest(salt: bytes, password: str) -> str:
    """The stored form of a password: HMAC-SHA256 keyed by the user's salt, hex."""
    return hmac.new(salt, password.encode(), hashlib.sha256).hexdigest()


def _entry(password: str, tenant: str | None = None) -> dict[str, str]:
    salt = secrets.token_bytes(16)
    return {"salt": salt.hex(), "sha256": digest(salt, password), **({"tenant": tenant} if tenant else {})}


def entries(nats: Mapping[str, str], tenants: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """User name -> its stored entry: the task roles' users and every tenant's users."""
    out = {role: _entry(nats[role]) for role in TASK_ROLES if role in nats}
    for name, t in sorted(tenants.items()):
        for user, password in sorted((t.get("users") or {}).items()):
            out[tn.user_name(name, user)] = _entry(str(password), name)
    return out


def write(secrets_path: Path, nats: Mapping[str, str], tenants: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write the task users of these secrets beside their file (0600, atomically: an executor
    reading it sees the old or the new one whole)."""
    from .auth import write_private

    target = Path(secrets_path).with_name(FILE)
    write_private(target, json.dumps({"version": VERSION, "users": entries(nats, tenants)}, indent=1) + "\n")
    return target


def env(data_dir: Path) -> dict[str, str]:
    """The executor's setting naming the file (``AIOS_EXECUTOR_HTTP_USERS``)."""
    return {"AIOS_EXECUTOR_HTTP_USERS": str(path(data_dir))}


def sync(data_dir: Path) -> Path | None:
    """Write the task users of the data dir's secrets (none there yet: nothing)."""
    secrets_path = Path(data_dir).resolve() / "auth" / "secrets.json"
    try:
        d = json.loads(secrets_path.read_text())
    except FileNotFoundError:
        return None
    return write(secrets_path, d.get("nats") or {}, d.get("tenants") or {})
