"""A token per instance (docs/security.md "Instances' ports: a token per instance").

An instance's own HTTP port answers only whoever knows its token. The token cannot travel with
the instance's start command, as ``AIOS_INSTANCE_ID`` does: that command is stored in ``AIOS``,
which every observer reads. So it is derived, in two steps, from one system key ``K``:

* ``K``: ``<data dir>/auth/instance-key`` (0600, beside ``task-users.json``; made when the
  embedded servers start with auth on), or ``AIOS_INSTANCE_KEY`` on your own servers. The
  executors hold it (and the simulated fleet, which plays every simulated node);
* node N's agent gets only ``K_N = node_key(K, N)`` (``AIOS_INSTANCE_NODE_KEY``:
  ``Endpoints.agent_env`` beside its NATS user; an agent elsewhere from its operator,
  ``blocks instance-key --node-id N``), so an agent learns no other node's tokens;
* the agent starts instance I with ``AIOS_INSTANCE_TOKEN = instance_token(K_N, I)``; an executor
  computes the same from the instance map's node and instance ids on each try and sends it as
  ``Aios-Instance-Token`` (no per-instance state anywhere).

HMAC-SHA256 each, with a label per step (``aios-instance-node:``, ``aios-instance:``), so neither
value can stand for the other, nor for the keyed event ids' ``agent_key``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

#: the key's file, beside ``secrets.json`` and ``task-users.json``
FILE = "instance-key"
#: ``K``, for the executors (and the simulated fleet)
KEY_ENV = "AIOS_INSTANCE_KEY"
#: ``K_N``, for node N's agent
NODE_KEY_ENV = "AIOS_INSTANCE_NODE_KEY"


def path(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / "auth" / FILE


def node_key(key: str, node_id: str) -> str:
    """``K_N``: node ``node_id``'s key, derived from the system's (hex)."""
    return hmac.new(key.encode(), f"aios-instance-node:{node_id}".encode(), hashlib.sha256).hexdigest()


def instance_token(node_key_: str, instance_id: str) -> str:
    """The token of instance ``instance_id`` from its node's key (hex)."""
    return hmac.new(node_key_.encode(), f"aios-instance:{instance_id}".encode(), hashlib.sha256).hexdigest()


def token(key: str, node_id: str, instance_id: str) -> str:
    """What an executor sends instance ``instance_id`` of node ``node_id`` (``Aios-Instance-Token``)."""
    return instance_token(node_key(key, node_id), instance_id)


def ensure(data_dir: Path) -> str:
    """The data dir's key, made (256 random bits, hex, 0600) when there is none yet."""
    target = path(data_dir)
    try:
        return target.read_text().strip()
    except FileNotFoundError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: two processes making it at once keep the first one's
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return target.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return target.read_text().strip()


def read(data_dir: Path) -> str | None:
    """The data dir's key, ``None`` when it has none."""
    try:
        return path(data_dir).read_text().strip() or None
    except FileNotFoundError:
        return None


def executor_env(data_dir: Path) -> dict[str, str]:
    """``AIOS_INSTANCE_KEY`` for an executor (or the simulated fleet) of this data dir."""
    key = read(data_dir)
    return {KEY_ENV: key} if key else {}


def agent_env(data_dir: Path, node_id: str) -> dict[str, str]:
    """``AIOS_INSTANCE_NODE_KEY`` for node ``node_id``'s agent: its node's key only."""
    key = read(data_dir)
    return {NODE_KEY_ENV: node_key(key, node_id)} if key else {}
