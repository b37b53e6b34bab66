"""``blocks task``: one task to a block, through an executor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.markup import escape

from .common import DataDir, _block_id, _run, _seconds_over, _urls, err


def task(
    bid: str = typer.Argument(..., help="Block id.", callback=_block_id),
    data: str = typer.Option("{}", "--data", "-d", help="The task's body: JSON text, or @FILE (any bytes)."),
    idempotent: bool = typer.Option(False, "--idempotent", help="Mark the task idempotent: it may be retried on another instance."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for the answer.", callback=_seconds_over()),
    data_dir: Path = DataDir,
) -> None:
    """Send one task to a block over NATS (through an executor) and print the answer. Exit 0
    answered (2xx), 1 unknown block, 2 bad input, 3 failed (the instance's or executor's error,
    e.g. overloaded: retry after the time printed), 5 timed out.

    Example: `blocks task blk-1234 --data '{"prompt": "hi"}'`, `blocks task blk-1234 -d @image.png`
    """
    if data.startswith("@"):
        try:
            body = Path(data[1:]).read_bytes()
        except OSError as exc:
            err.print(f"[red]cannot read {escape(data[1:])}: {exc}[/]")
            raise typer.Exit(2)
        ctype = "application/json" if data.endswith(".json") else "application/octet-stream"
    else:
        try:
            json.loads(data)
        except ValueError as exc:
            err.print(f"[red]--data is not JSON[/]: {escape(str(exc))} (use @FILE for other bodies)")
            raise typer.Exit(2)
        body, ctype = data.encode(), "application/json"
    headers = {"Content-Type": ctype, "Aios-Timeout-Ms": str(int(timeout * 1000))}
    if idempotent:
        headers["Aios-Idempotent"] = "true"

    from ..bus.nats_bus import Bus
    from .client import CONNECT_WAIT_S, send_task

    nats_url, _ = _urls(data_dir)  # NATS only: AIOS_ROLE=upstream works

    async def go() -> tuple[int, bytes, dict[str, str]]:
        bus = await Bus.open(nats_url, source="aios-blocks/cli", first_wait_s=CONNECT_WAIT_S)
        try:
            return await send_task(bus, bid, body, headers, timeout + 1)
        finally:
            await bus.close()

    try:
        status, out, h = _run(go())
    except TimeoutError:
        err.print(f"[red]timed out[/]: no answer from block {escape(bid)} within {timeout:g} s (is an executor running?)")
        raise typer.Exit(5)
    if 200 <= status < 300:
        sys.stdout.buffer.write(out)
        if out and not out.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
        raise typer.Exit(0)
    why = h.get("Aios-Error") or out.decode(errors="replace")[:2000]
    retry = f" (retry after {h['Retry-After-Ms']} ms)" if h.get("Retry-After-Ms") else ""
    err.print(f"[red]{status}[/] {escape(why)}{retry}")
    raise typer.Exit(1 if status == 404 and "Aios-Instance" not in h else 5 if status == 504 else 3)
