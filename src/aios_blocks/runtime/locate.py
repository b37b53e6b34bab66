"""Where a running ``blocks up`` is and how a role logs in to it: the data dir (found as git finds
``.git``), its ``endpoints.json`` and, when the servers require credentials, the role's password
from ``auth/secrets.json`` (read only).

Standard library only: every CLI command resolves its servers through here, and a command's
start-up should not pay for the permission tables of ``runtime.auth`` or the settings model
(issue 32: ``blocks list`` within a few times the import of typer and rich).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..schemas.roles import REDIS_USER

#: the data dir when neither ``--data-dir`` nor ``AIOS_DATA_DIR`` names one (the CLI resolves those)
DEFAULT_DATA_DIR = Path(".aios-data")

#: NATS role -> Redis user (node agents and upstream publishers get no Redis access at all).
REDIS_ROLE = REDIS_USER


def with_userinfo(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


def find_data_dir(start: Path | None = None) -> Path | None:
    """The nearest ``.aios-data`` with a running system (``endpoints.json``) in ``start`` (default
    the working directory) or one of its parents, as git finds ``.git``."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / DEFAULT_DATA_DIR / "endpoints.json").exists():
            return d / DEFAULT_DATA_DIR
    return None


def secret_values(data_dir: Path) -> dict[str, dict[str, str]]:
    """The role passwords of ``auth/secrets.json`` as stored (``nats``, ``redis``, ...; read only:
    ``auth.Secrets`` creates and completes the file)."""
    doc: dict[str, dict[str, str]] = json.loads((Path(data_dir) / "auth" / "secrets.json").read_text())
    return doc


class CredentialsUnreadable(OSError):
    """``endpoints.json`` or ``auth/secrets.json`` of a data dir cannot give a role its login: the
    message names the file and what is wrong with it (never a secret). An ``OSError``, as the
    missing or unreadable file it was before (``except (OSError, KeyError)`` still holds)."""


def _json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, else :class:`CredentialsUnreadable` saying why (``what``: the file's role)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CredentialsUnreadable(f"{path} does not exist ({what})") from None
    except PermissionError:
        raise CredentialsUnreadable(f"{path} is not readable by this user ({what}: only the user who ran "
                                    "`blocks up` may read it)") from None
    except OSError as exc:
        raise CredentialsUnreadable(f"{path} cannot be read: {exc.strerror or type(exc).__name__}") from None
    except json.JSONDecodeError as exc:  # (its position only: no byte of the file is shown)
        raise CredentialsUnreadable(f"{path} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
                                    f"{what}") from None
    except ValueError:
        raise CredentialsUnreadable(f"{path} is not UTF-8 text ({what})") from None
    if not isinstance(doc, dict):
        raise CredentialsUnreadable(f"{path} does not hold a JSON object ({what})")
    return doc


#: what ``endpoints.json`` is, in the messages that say what is wrong with it
ENDPOINTS_WHAT = "where the running servers listen, written by `blocks up`"


def endpoints_problem(data_dir: Path) -> str:
    """Why ``data_dir``'s ``endpoints.json`` is not what ``blocks up`` writes (for a reader that
    failed on it): the file and every problem :func:`_check_login` names, else that it is not."""
    ep = Path(data_dir) / "endpoints.json"
    try:
        _check_login(data_dir, _json_object(ep, ENDPOINTS_WHAT), False, True, "admin")
    except CredentialsUnreadable as exc:
        return str(exc)
    return f"{ep} is not what `blocks up` writes"


def _check_login(data_dir: Path, endpoints: dict[str, Any], auth: bool, acl: bool, role: str) -> None:
    """Whether ``endpoints`` and the secrets file give ``role`` what it logs in with, every missing
    part named in one :class:`CredentialsUnreadable` (a ``KeyError`` said only ``KeyError``)."""
    ep = Path(data_dir) / "endpoints.json"
    problems = [f"{ep} has no {k!r} address" for k in ("nats", "redis") if not isinstance(endpoints.get(k), str)]
    if auth:
        problems += _login_problems(Path(data_dir) / "auth" / "secrets.json", acl, role)
    if problems:
        raise CredentialsUnreadable("; ".join(problems))


def _login_problems(path: Path, acl: bool, role: str) -> list[str]:
    """What the secrets file ``path`` lacks for ``role``'s NATS and Redis logins."""
    try:
        doc = _json_object(path, "the role passwords `blocks up` wrote")
    except CredentialsUnreadable as exc:
        return [str(exc)]
    nats, redis, user = doc.get("nats"), doc.get("redis"), REDIS_ROLE.get(role)
    problems = []
    if not isinstance(nats, dict) or not isinstance(nats.get(role), str):
        problems.append(f"{path} has no NATS password for role {role!r}")
    if user is not None and (not isinstance(redis, dict) or not isinstance(redis.get(user if acl else "admin"), str)):
        problems.append(f"{path} has no Redis password for user {user if acl else 'admin'!r}")
    return problems


def nats_role_url(bare: str, data_dir: Path, auth: bool, role: str) -> str:
    """``bare`` with ``role``'s NATS user and password (``bare`` itself without credentials)."""
    if not auth:
        return bare
    return with_userinfo(bare, role, secret_values(data_dir)["nats"][role])


def redis_role_url(bare: str, data_dir: Path, auth: bool, acl: bool, role: str) -> str | None:
    """``bare`` with the Redis user of ``role`` (``None``: the role has no Redis access; Redis < 6
    has no ACL users: everyone logs in with the one password)."""
    if not auth:
        return bare
    user = REDIS_ROLE.get(role)
    if user is None:
        return None
    redis = secret_values(data_dir)["redis"]
    if not acl:
        return with_userinfo(bare, "", redis["admin"])
    return with_userinfo(bare, user, redis[user])


#: how long a command waits for a `blocks up` that is starting in its data dir to write endpoints.json
STARTING_WAIT_S = 60.0


def starting(data_dir: Path) -> bool:
    """Whether a `blocks up` is starting in ``data_dir``: it holds the data dir's lock
    (``lifetime.DataDirLock``) and has not written ``endpoints.json`` yet."""
    from .lifetime import in_use  # stdlib only, like this module

    return not (Path(data_dir) / "endpoints.json").exists() and in_use(data_dir)


def _say_waiting(data_dir: Path) -> None:
    try:
        pid = f" (pid {(Path(data_dir) / 'lock').read_text().strip()})"
    except OSError:
        pid = ""
    sys.stderr.write(f"`blocks up`{pid} is starting in {data_dir}: waiting for its servers\n")
    sys.stderr.flush()


def wait_while_starting(data_dir: Path, wait_s: float = STARTING_WAIT_S,
                        on_wait: Callable[[Path], None] | None = _say_waiting) -> None:
    """Return once ``data_dir`` has ``endpoints.json``, or nobody holds its lock (the `blocks up`
    gave up), or after ``wait_s``: a command typed right after ``blocks up &`` (as the README's
    lines are) finds the servers instead of saying there are none. ``on_wait`` is told once, when
    there is something to wait for."""
    if not starting(data_dir):
        return
    if on_wait is not None:
        on_wait(Path(data_dir))
    deadline = time.monotonic() + wait_s
    while starting(data_dir) and time.monotonic() < deadline:
        time.sleep(0.05)


def resolve_urls(data_dir: Path = DEFAULT_DATA_DIR, role: str | None = None, wait_s: float = STARTING_WAIT_S,
                 on_wait: Callable[[Path], None] | None = _say_waiting) -> tuple[str, str] | None:
    """URLs from the environment, else from a running ``blocks up`` in ``data_dir`` with the
    credentials of ``role`` (default ``AIOS_ROLE``, else admin; the secrets file must be readable);
    one that is still starting there is waited for (up to ``wait_s``, ``wait_while_starting``).
    Sets ``AIOS_NATS_CA`` when the embedded NATS serves TLS. ``None``: neither.
    :class:`CredentialsUnreadable` when either file cannot give ``role`` its login (it says why)."""
    nats_url, redis_url = os.environ.get("AIOS_NATS_URL"), os.environ.get("AIOS_REDIS_URL")
    if nats_url and redis_url:
        return nats_url, redis_url
    ep = Path(data_dir) / "endpoints.json"
    if not ep.exists() and wait_s > 0:
        wait_while_starting(data_dir, wait_s, on_wait)
    if not ep.exists():
        return None
    d = _json_object(ep, ENDPOINTS_WHAT)
    auth, where = bool(d.get("auth")), Path(data_dir).resolve()
    role = role or os.environ.get("AIOS_ROLE") or "admin"
    _check_login(where, d, auth, bool(d.get("redis_acl", True)), role)
    if d.get("nats_ca"):
        os.environ.setdefault("AIOS_NATS_CA", d["nats_ca"])
        if "aios_blocks.settings" in sys.modules:  # the process's settings now include the CA
            sys.modules["aios_blocks.settings"].load.cache_clear()
    return (nats_url or nats_role_url(d["nats"], where, auth, role),
            redis_url or redis_role_url(d["redis"], where, auth, d.get("redis_acl", True), role) or d["redis"])
