"""The console's admin token: a random string in ``<data dir>/console/token`` (mode 0600).

Standard library only: the lean `blocks up` process (cli/up.py) creates and prints it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def token_path(data_dir: Path) -> Path:
    return Path(data_dir) / "console" / "token"


def ensure_token(data_dir: Path) -> str:
    """The data dir's token, made (0600, in a 0700 folder) when there is none yet."""
    path = token_path(data_dir)
    try:
        text = path.read_text().strip()
        if text:
            return text
    except OSError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    value = secrets.token_urlsafe(24)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
    return value
