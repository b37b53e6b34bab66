"""Side-cars: a NATS user per block (docs/security.md "Side-cars: a user per block").

Every side-car used to log in as the one user ``sidecar``, so one block's side-car could read and
ack another block's outputs. A node agent next to ``blocks up`` (``AIOS_SIDECAR_USERS_DIR``: the
data dir, in ``Endpoints.agent_env``) now gives each block's side-cars the user ``sidecar-<bid>``,
whose rights are that block's durables, outputs, dead letters and alerts only. The password is
made here and kept in the secrets file; it reaches the side-car through the agent's environment
for it, never through the stored ``node.sidecar.start`` command that observers read. Config-file
users cannot be templated, so each new block (or side-car name) is one config rewrite and reload,
as for a node agent (``auth.ensure_agent``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..bus import subjects
from ..bus.catalog import E
from ..schemas.spec import ID_RE
from .auth import (
    JS,
    Endpoints,
    Permissions,
    Secrets,
    _token,
    inbox_prefix,
    locked,
    read_endpoints,
    reload_and_wait,
    wait_nats_user,
    with_userinfo,
)


def sidecar_user(bid: str) -> str:
    """The NATS user of block ``bid``'s side-cars (docs/security.md "Side-cars: a user per block")."""
    if not ID_RE.match(bid):
        raise ValueError(f"invalid block id {bid!r}: must match {ID_RE.pattern}")
    return f"sidecar-{bid}"


def sidecar_permissions(bid: str, names: Iterable[str]) -> Permissions:
    """Block ``bid``'s side-cars: each one's durable on ``AIOS_OUTPUTS`` created only with a filter
    on the block's outputs *in the subject* (``CONSUMER.CREATE.<stream>.<durable>.<filter>``, which
    the server checks against the request's body, so the filter is the server's word), its info,
    pulls and acks, its dead letters and its alerts; nothing of another block's."""
    so = subjects.STREAM_OUTPUTS
    outputs = E.block_output.filter(bid=bid, outcome="*").rsplit(".", 1)[0]  # aios.output.<bid>
    pub: list[str] = []
    for name in sorted(set(names)):
        d = subjects.sidecar_durable(bid, name)
        pub += [f"{JS}.CONSUMER.INFO.{so}.{d}", f"{JS}.CONSUMER.CREATE.{so}.{d}.{outputs}.>",
                f"{JS}.CONSUMER.MSG.NEXT.{so}.{d}", f"$JS.ACK.{so}.{d}.>", E.output_dead_letter.subject(bid=bid, name=name, outcome="*"),
                E.sidecar_alert.subject(bid=bid, name=name)]
    return Permissions(tuple(pub), (f"{inbox_prefix(sidecar_user(bid))}.>",))


class SidecarUsers:
    """A user per block for its side-cars on the embedded server of ``data_dir`` (the node agents
    next to ``blocks up``, ``AIOS_SIDECAR_USERS_DIR``): ``grant`` adds the side-car's name to the
    block's user (made with a fresh password on first use) and the node to those running it, and
    returns its URL; ``release`` takes the node off, and the user goes with the last node. The
    password goes from the secrets file to the side-car's environment, never into a stored command."""

    def __init__(self, data_dir: Path, timeout: float = 10.0) -> None:
        self.data_dir, self.timeout = Path(data_dir).resolve(), timeout

    def _endpoints(self) -> Endpoints:
        ep = read_endpoints(self.data_dir)
        if ep is None or not ep.auth:
            raise RuntimeError(f"no embedded servers with credentials in {self.data_dir}")
        return ep

    def grant(self, bid: str, name: str, node: str) -> str:
        ep = self._endpoints()
        user = sidecar_user(bid)
        durable = subjects.sidecar_durable(bid, name)
        with locked(self.data_dir):
            s = Secrets.load(self.data_dir, create=False)
            for other, e in s.sidecars.items():  # sidecar-a + b-x and sidecar-a-b + x: one durable name
                if other != bid and durable in {subjects.sidecar_durable(other, n) for n in e.get("names", [])}:
                    raise ValueError(f"side-car consumer {durable} is block {other}'s already")
            entry = s.sidecars.setdefault(bid, {"password": _token(), "names": [], "nodes": []})
            rights = name not in entry["names"]  # a new user or a new durable: the config changes
            saved = rights or node not in entry["nodes"]  # a new node only: the secrets file alone
            entry["names"] = sorted({*entry["names"], name})
            entry["nodes"] = sorted({*entry["nodes"], node})
            if saved:
                s.save()
            if rights:
                reload_and_wait(self.data_dir, s, self.timeout)
            url = with_userinfo(ep.nats, user, entry["password"])
        wait_nats_user(url, ep.nats_ca, self.timeout)
        return url

    def release(self, bid: str, node: str) -> bool:
        """Whether the block's user is gone (no node runs its side-cars any more)."""
        with locked(self.data_dir):
            s = Secrets.load(self.data_dir, create=False)
            entry = s.sidecars.get(bid)
            if entry is None:
                return True
            entry["nodes"] = [n for n in entry["nodes"] if n != node]
            if entry["nodes"]:
                s.save()
                return False
            del s.sidecars[bid]
            s.save()
            reload_and_wait(self.data_dir, s, self.timeout)
            return True
