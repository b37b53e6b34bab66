"""A side-car that alerts when an output matches a pattern.

Parameters: ``pattern`` (a regex, searched in the output's text; required), ``file`` (optional:
each alert is also appended to it as one JSON line), ``outcome`` (``any``, ``ok`` or ``error``:
which outputs to look at; default ``any``). An alert is published on core NATS
(``aios.block.{bid}.sidecar.{name}.alert``: ``blocks``' observers and any subscriber see it) and
logged.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from ... import sidecar


class Alerter:
    def __init__(self, parameters: dict[str, Any]):
        pattern = parameters.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise SystemExit("alert: parameters.pattern (a regex) is required")
        try:
            self.rx = re.compile(pattern)
        except re.error as exc:
            raise SystemExit(f"alert: parameters.pattern {pattern!r} is not a valid regex: {exc}") from None
        self.file = Path(str(parameters["file"])) if parameters.get("file") else None
        self.outcome = str(parameters.get("outcome") or "any")
        self.lock = threading.Lock()

    def __call__(self, out: sidecar.Output, ctx: sidecar.Context) -> None:
        if self.outcome != "any" and out.outcome != self.outcome:
            return
        m = self.rx.search(out.text)
        if m is None:
            return
        message = f"output of task {out.task_id} (instance {out.instance_id}, status {out.status}) matches {self.rx.pattern!r}: {m.group(0)[:200]!r}"
        ctx.alert(message, out.task_id)
        if self.file is not None:
            with self.lock, self.file.open("a") as f:
                f.write(json.dumps({"task_id": out.task_id, "block_id": out.block_id, "match": m.group(0)[:200],
                                    "message": message, "time": time.time()}) + "\n")


def main() -> None:
    cfg = sidecar.Config.from_env()
    sidecar.run(Alerter(cfg.parameters), cfg)


if __name__ == "__main__":
    main()
