"""Who may send tasks over the executors' HTTP port (docs/security.md "The executors' HTTP port").

Over NATS the server decides: the ``upstream`` and ``admin`` roles may request
``aios.block.B.task``, and a tenant's users their own blocks' (through the gateway's tenant desk).
The executors' HTTP port asks for the same users with the same passwords (HTTP Basic), so it
needs to know them. It is given **hashes**, not the passwords: the process that runs the embedded
servers (``blocks up``: ``EmbeddedServers``) writes ``<data dir>/auth/task-users.json`` (0600), one
salted SHA-256 per user that may send tasks, when it starts and again whenever ``secrets.json``
changes (``Keeper``: tenant users added or removed by any ``blocks tenant`` command); the executor
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
import os
import secrets
import threading
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


def exists(data_dir: Path) -> bool:
    return os.path.exists(path(data_dir))


def _stat(p: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Keeper:
    """Keeps ``task-users.json`` in step with ``secrets.json`` (both replaced whole, never written in
    place): ``sync`` rewrites it when the secrets' stat changed since the last sync; ``start`` runs
    that every ``interval`` seconds in a daemon thread of the process that runs the servers (a
    tenant user added or removed by another process is let in or out within that)."""

    def __init__(self, data_dir: Path, interval: float = 0.25):
        self.secrets = Path(data_dir).resolve() / "auth" / "secrets.json"
        self.interval = interval
        self._seen: tuple[int, int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync(self) -> bool:
        """Whether it wrote the file (the secrets changed, or it is missing)."""
        key = _stat(self.secrets)
        if key is None or (key == self._seen and exists(self.secrets.parent.parent)):
            return False
        try:
            d = json.loads(self.secrets.read_text())
        except (OSError, ValueError):  # replaced between the stat and the read: the next round
            return False
        write(self.secrets, d.get("nats") or {}, d.get("tenants") or {})
        self._seen = key
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception:  # a full disk, say: keep trying; the executors keep the last file
                continue

    def start(self) -> Keeper:
        self.sync()
        self._thread = threading.Thread(target=self._run, name="task-users", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
