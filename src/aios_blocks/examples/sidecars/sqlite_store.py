"""A side-car that writes every task output of its block to a SQLite file (stdlib ``sqlite3``).

Parameters: ``path`` (the database file; relative paths are in the side-car's working directory;
default ``outputs.db``), ``table`` (default ``outputs``), ``failOn`` (a substring: an output whose
text contains it makes the handler raise - to see retries and dead letters).

Idempotent by task id: the task id is the primary key and rows are ``INSERT OR IGNORE``d, so an
output delivered again (the side-car was killed before its ack) is stored once.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path
from typing import Any

from ... import sidecar

SCHEMA = """CREATE TABLE IF NOT EXISTS {table} (
    task_id TEXT PRIMARY KEY, block_id TEXT NOT NULL, instance_id TEXT NOT NULL, status INTEGER NOT NULL,
    outcome TEXT NOT NULL, output TEXT NOT NULL, truncated INTEGER NOT NULL, size INTEGER NOT NULL,
    time REAL NOT NULL, stored_at REAL NOT NULL DEFAULT (julianday('now')), deliveries INTEGER NOT NULL)"""


class Store:
    """One SQLite connection (handlers run in a worker thread: guarded by a lock)."""

    def __init__(self, parameters: dict[str, Any]):
        table = str(parameters.get("table") or "outputs")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", table):
            raise SystemExit(f"sqlite_store: table {table!r} is not a plain SQL name")
        self.table = table
        self.path = Path(str(parameters.get("path") or "outputs.db"))
        self.fail_on = str(parameters.get("failOn") or "")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(SCHEMA.format(table=table))
        self.lock = threading.Lock()

    def __call__(self, out: sidecar.Output, ctx: sidecar.Context) -> None:
        if self.fail_on and self.fail_on in out.text:
            raise RuntimeError(f"refusing outputs that contain {self.fail_on!r}")
        with self.lock:
            self.db.execute(
                f"INSERT OR IGNORE INTO {self.table} (task_id, block_id, instance_id, status, outcome, output, truncated, size,"
                " time, deliveries) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (out.task_id, out.block_id, out.instance_id, out.status, out.outcome, out.text, int(out.truncated), out.size,
                 out.time, out.deliveries),
            )


def main() -> None:
    cfg = sidecar.Config.from_env()
    sidecar.run(Store(cfg.parameters), cfg)


if __name__ == "__main__":
    main()
