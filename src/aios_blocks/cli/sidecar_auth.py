"""``blocks sidecar-auth``: side-cars on your own NATS get a user per block through auth callout
(docs/security.md "Side-cars on your own NATS: auth callout"; ``runtime/sidecar_callout.py``).

``init`` makes the state (the issuer's nkey seed, 0600) and prints what to paste into the server's
config; ``serve`` answers the server's callouts and the node agents' grants. Needs the
``sidecar-auth`` extra (``pip install 'aios-blocks[sidecar-auth]'``: nkeys).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape

from .common import console, err

app = typer.Typer(help="Side-cars' users per block on your own NATS, through auth callout (docs/security.md).",
                  no_args_is_help=True)

StateDir = typer.Option(..., "--state-dir", help="where the issuer's seed and the blocks' passwords live (0700; keep it secret)")
Account = typer.Option("AIOS", "--account", help="the server's account of the system's users (side-cars are placed in it)")


def _nkeys() -> None:
    try:
        import nkeys  # noqa: F401
    except ImportError:
        err.print("[red]nkeys is not installed.[/] pip install 'aios-blocks\\[sidecar-auth]'")
        raise typer.Exit(2) from None


@app.command("init")
def init(state_dir: Path = StateDir, account: str = Account) -> None:
    """Make the state (once; again: the same issuer) and print the config for your nats-server.

    Example: `blocks sidecar-auth init --state-dir /etc/aios/sidecar-auth`
    """
    _nkeys()
    import secrets

    from ..runtime import sidecar_callout as sc

    reg = sc.Registry.load(state_dir)
    password = secrets.token_urlsafe(24)
    console.print(escape(
        f"# 1. In your server's accounts block: the service's user among the system's users (account {account}),\n"
        f"#    and an account with no users, so that only unknown logins go to the service:\n"
        f"  {account}: {{ users: [ ..., {sc.service_user_conf(password)} ] }}\n"
        f"  {sc.CALLOUT_ACCOUNT}: {{}}\n"
        f"# 2. At the top level:\n{sc.config_block(reg.issuer, sc.xkey_public(reg.xkey_private), account)}"
        f"# 3. Each node agent's user may publish aios.node.<node id>.sidecar.grant and .release;\n"
        f"#    run the agents with AIOS_SIDECAR_AUTH=callout.\n"
        f"# 4. Reload the server, then run the service (the password above; keep it and {state_dir} secret):\n"
        f"#    AIOS_NATS_URL=nats://{sc.SERVICE_USER}:{password}@<host>:4222 blocks sidecar-auth serve --state-dir {state_dir}"),
        highlight=False)


@app.command("serve")
def serve(state_dir: Path = StateDir, account: str = Account) -> None:
    """Answer the server's auth callouts and the node agents' grants (AIOS_NATS_URL: the service's user).

    Example: `AIOS_NATS_URL=nats://sidecar-auth:PASSWORD@10.0.0.5:4222 blocks sidecar-auth serve --state-dir /etc/aios/sidecar-auth`
    """
    _nkeys()
    import asyncio

    from ..runtime import sidecar_callout as sc

    url = os.environ.get("AIOS_NATS_URL", "")
    if not url:
        err.print(f"[red]No NATS.[/] Set AIOS_NATS_URL to the server's URL as user {sc.SERVICE_USER}.")
        raise typer.Exit(2)
    if not (state_dir / sc.STATE_FILE).exists():
        err.print(f"[red]No state in {escape(str(state_dir))}.[/] Run `blocks sidecar-auth init` first.")
        raise typer.Exit(2)

    async def go() -> None:
        from ..workers.base import stop_on_signals

        await sc.serve(url, state_dir, stop_on_signals(), account=account)

    asyncio.run(go())
