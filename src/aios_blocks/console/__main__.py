"""``python -m aios_blocks.console --data-dir DIR [--host H] [--port P]``: the console's process
(what `blocks up` starts beside its workers, and what `blocks console` runs in the foreground)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from ..runtime.locate import resolve_urls
from .token import ensure_token, token_path


def run(data_dir: Path, host: str = "127.0.0.1", port: int = 0, say: Callable[[str], None] | None = None,
        show_token: bool = True) -> None:
    """Serve the console of the system in ``data_dir`` (or AIOS_NATS_URL / AIOS_REDIS_URL): reads
    with the observer role's credentials, actions (once the admin token is given) with the admin's
    when this user can read them. Raises LookupError when there is no running system."""
    from .server import admin_opener, serve

    observer = resolve_urls(data_dir, "observer")
    if observer is None:
        raise LookupError(f"no running `blocks up` in {data_dir} (no endpoints.json), and no AIOS_NATS_URL / AIOS_REDIS_URL")
    try:
        admin = resolve_urls(data_dir, "admin", wait_s=0)
    except (OSError, KeyError):
        admin = None
    token = ensure_token(data_dir)

    def ready(bound: int) -> None:
        url = f"http://{host}:{bound}/"
        admin = f"{url}#token={token}" if show_token else url + "#token=<the token>"
        (say or print)(f"console: {url}  (admin: {admin} ; token in {token_path(data_dir)})")
        sys.stdout.flush()

    asyncio.run(serve(observer[0], host, port, token, admin_opener(*admin) if admin else None, ready, redis_url=observer[1]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m aios_blocks.console", description=__doc__)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    try:
        # (`blocks up` prints the token itself: its child's log does not carry it)
        run(args.data_dir, args.host, args.port, show_token=False)
    except KeyboardInterrupt:
        pass
    except LookupError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
