"""Side-cars on an external NATS: a user per block through auth callout (docs/security.md
"Side-cars on your own NATS: auth callout").

Next to ``blocks up`` the node agent writes each block's side-car user into the config it owns
(``runtime.sidecar_users``). An operator's own server has a config we do not write, so there the
server asks a service of ours about every login it does not know (NATS auth callout, nats-server
>= 2.10): ``$SYS.REQ.USER.AUTH`` carries a JWT the server signed with the client's CONNECT
options; the service answers with a JWT signed by the issuer key the server's config names,
carrying a user JWT whose permissions are exactly the block's side-car rights
(``sidecar_users.sidecar_permissions``: both paths grant the same), or an error.

The credentials are the embedded path's: user ``sidecar-<bid>`` and a random password per block,
kept by this service (``sidecar-auth.json``, 0600, with the issuer's seed) and handed to the node
agent that runs the block's side-cars on request (``aios.node.<nid>.sidecar.grant``, core NATS:
the answer goes to the agent's private inbox, never to a stream), as ``SidecarUsers.grant`` reads
them from the secrets file. The request names the stream sequence of the ``node.sidecar.start``
command the agent runs (only the controller publishes those): the service reads it from ``AIOS``
and grants only the block and side-car that command sent to that node. The registry also refuses a side-car name whose durable is another
block's (``sidecar-a`` + ``b-x`` = ``sidecar-a-b`` + ``x``) and forgets a block when its last
node lets go (``.release``). JWTs are written here (nats-io/jwt v2 claims: header
``{"typ":"JWT","alg":"ed25519-nkey"}``, base64url without padding, ``jti`` the base32 SHA-256 of
the claims) and signed with ``nkeys`` (the ``sidecar-auth`` extra). With the config's ``xkey`` the
server's requests (the password among them) and our answers are sealed (nkeys' ``xkv1``: X25519,
NaCl's box, through PyNaCl), so another listener on the callout subject reads nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ..bus import subjects
from ..bus.catalog import E
from ..schemas.spec import ID_RE
from .sidecar_users import sidecar_permissions, sidecar_user

log = structlog.get_logger(__name__)

#: where the server asks (nats-server's ``AuthCalloutSubject``)
AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
#: the system's account on the operator's server (docs/security.md "An external NATS")
ACCOUNT = "AIOS"
#: the service's own NATS user (in the config's ``auth_users``)
SERVICE_USER = "sidecar-auth"
#: an account with no users: the one ``allowed_accounts`` names, so that the server sends only the
#: logins it does not know to the callout, never those of its configured users (agents, workers)
CALLOUT_ACCOUNT = "AIOS_SIDECAR_CALLOUT"
STATE_FILE = "sidecar-auth.json"


grant_subject, release_subject = subjects.node_sidecar_grant, subjects.node_sidecar_release


# -- JWTs ---------------------------------------------------------------------------------------
def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_account_seed() -> bytes:
    """A fresh account nkey seed (``SA...``): the callout's issuer."""
    import nkeys

    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))


def encode_jwt(claims: dict[str, Any], seed: bytes) -> str:
    """``claims`` signed by the nkey of ``seed`` (its public key becomes ``iss``)."""
    import nkeys

    kp = nkeys.from_seed(seed)
    body = {**claims, "iss": kp.public_key.decode(), "iat": int(time.time())}
    body.pop("jti", None)
    digest = hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    return f"{head}.{payload}.{_b64(kp.sign(f'{head}.{payload}'.encode()))}"


#: an xkey (X25519 curve key) public key's first byte: base32 ``X``
PREFIX_BYTE_CURVE = 23 << 3
#: nkeys' sealed box: this version, a 24-byte nonce, then NaCl's box (tag and ciphertext)
XKV1 = b"xkv1"
#: the header in which the server names its xkey when it encrypts its requests
XKEY_HEADER = "Nats-Server-Xkey"


def xkey_public(private: bytes) -> str:
    """The ``X...`` public key of a raw X25519 private key."""
    import nacl.public
    import nkeys

    raw = bytes([PREFIX_BYTE_CURVE]) + bytes(nacl.public.PrivateKey(private).public_key)
    return base64.b32encode(raw + nkeys.crc16_checksum(raw)).decode().rstrip("=")


def _xkey_raw(public: str) -> bytes:
    import nkeys

    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35 or raw[0] != PREFIX_BYTE_CURVE or nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        raise ValueError(f"not an xkey public key: {public!r}")
    return raw[1:-2]


def seal(data: bytes, private: bytes, recipient: str) -> bytes:
    """``data`` encrypted for ``recipient`` (an ``X...`` key) as nkeys' ``Seal`` does."""
    import nacl.public
    import nacl.utils

    box = nacl.public.Box(nacl.public.PrivateKey(private), nacl.public.PublicKey(_xkey_raw(recipient)))
    return XKV1 + bytes(box.encrypt(data, nacl.utils.random(24)))


def unseal(data: bytes, private: bytes, sender: str) -> bytes:
    import nacl.public

    if not data.startswith(XKV1):
        raise ValueError("not an xkv1 sealed message")
    box = nacl.public.Box(nacl.public.PrivateKey(private), nacl.public.PublicKey(_xkey_raw(sender)))
    return bytes(box.decrypt(data[len(XKV1) + 24:], data[len(XKV1):len(XKV1) + 24]))


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of ``token``, its signature checked against its own issuer (``iss``): the server's
    key for a request (the subject only the server publishes on is what vouches for it)."""
    import nacl.exceptions
    import nacl.signing
    import nkeys

    head, payload, sig = token.split(".")
    claims: dict[str, Any] = json.loads(_unb64(payload))
    raw = base64.b32decode(claims["iss"] + "=" * (-len(claims["iss"]) % 8))[1:-2]  # prefix byte, crc16
    try:
        nacl.signing.VerifyKey(raw).verify(f"{head}.{payload}".encode(), _unb64(sig))
    except nacl.exceptions.BadSignatureError as exc:
        raise nkeys.ErrInvalidSignature() from exc
    return claims


def user_claims(user_nkey: str, bid: str, names: list[str], account: str = ACCOUNT) -> dict[str, Any]:
    """A user JWT's claims (non-operator mode: ``aud`` places the user in ``account``) with block
    ``bid``'s side-car rights, the same as the config-file user's."""
    perms = sidecar_permissions(bid, names)
    return {"sub": user_nkey, "aud": account, "name": sidecar_user(bid),
            "nats": {"pub": {"allow": list(perms.publish)}, "sub": {"allow": list(perms.subscribe)},
                     "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}}


def response_claims(user_nkey: str, server_id: str, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    nats.update({"error": error} if error else {"jwt": user_jwt})
    return {"sub": user_nkey, "aud": server_id, "nats": nats}


# -- the registry: a password and side-car names per block ---------------------------------------
@dataclass
class Registry:
    """``sidecar-auth.json`` (0600, its directory 0700): the issuer's seed, the xkey the server
    encrypts its requests to and, per block whose side-cars run somewhere, its password, side-car
    names and nodes."""

    path: Path
    seed: str = ""
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)
    xkey: str = ""  # the X25519 private key, base64

    @classmethod
    def load(cls, state_dir: Path, create: bool = True) -> Registry:
        path = Path(state_dir) / STATE_FILE
        if path.exists():
            data = json.loads(path.read_text())
            return cls(path, data["issuer_seed"], data.get("blocks", {}), data["xkey"])
        if not create:
            raise FileNotFoundError(f"{path}: run `blocks sidecar-auth init` first")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        reg = cls(path, new_account_seed().decode(), xkey=base64.b64encode(os.urandom(32)).decode())
        reg.save()
        return reg

    @property
    def xkey_private(self) -> bytes:
        return base64.b64decode(self.xkey)

    @property
    def issuer(self) -> str:
        import nkeys

        return str(nkeys.from_seed(self.seed.encode()).public_key.decode())

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"issuer_seed": self.seed, "xkey": self.xkey, "blocks": self.blocks}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def grant(self, bid: str, name: str, node: str) -> str:
        """Block ``bid``'s password, with side-car ``name`` on ``node`` added to its rights."""
        durable = subjects.sidecar_durable(bid, name)
        for other, e in self.blocks.items():
            if other != bid and durable in {subjects.sidecar_durable(other, n) for n in e["names"]}:
                raise ValueError(f"side-car consumer {durable} is block {other}'s already")
        entry = self.blocks.setdefault(bid, {"password": secrets.token_urlsafe(24), "names": [], "nodes": []})
        if name not in entry["names"] or node not in entry["nodes"]:
            entry["names"] = sorted({*entry["names"], name})
            entry["nodes"] = sorted({*entry["nodes"], node})
            self.save()
        return str(entry["password"])

    def release(self, bid: str, node: str) -> bool:
        """Whether the block is forgotten (no node runs its side-cars any more)."""
        entry = self.blocks.get(bid)
        if entry is None:
            return True
        entry["nodes"] = [n for n in entry["nodes"] if n != node]
        if not entry["nodes"]:
            del self.blocks[bid]
        self.save()
        return bid not in self.blocks

    def check(self, user: str, password: str) -> tuple[str, list[str]]:
        """(block, side-car names) of a login, or ``PermissionError`` saying why not."""
        if not user:
            raise PermissionError("no user name (side-cars log in as sidecar-<block id>)")
        bid = user.removeprefix("sidecar-")
        entry = self.blocks.get(bid) if user.startswith("sidecar-") and ID_RE.match(bid) else None
        if entry is None:
            raise PermissionError(f"user {user!r} is no running block's side-car user")
        if not password or not hmac.compare_digest(password.encode(), str(entry["password"]).encode()):
            raise PermissionError(f"wrong password for {user!r}")
        return bid, list(entry["names"])


def config_block(issuer: str, xkey: str = "", account: str = ACCOUNT, service_user: str = SERVICE_USER) -> str:
    """The server config's ``authorization`` block for the callout (``xkey``: the server encrypts
    its requests, which carry the side-car's password, to it). The ``accounts`` block must also
    hold ``CALLOUT_ACCOUNT: {}`` (a second ``accounts`` block would replace the first) and the
    service's user in ``account`` (``service_user_conf``)."""
    xkey_line = f"    xkey: {xkey}\n" if xkey else ""
    return (f"authorization {{\n  auth_callout {{\n    issuer: {issuer}\n{xkey_line}    account: {account}\n"
            f"    auth_users: [ {service_user} ]\n    allowed_accounts: [ {CALLOUT_ACCOUNT} ]\n  }}\n}}\n")


def service_user_conf(password: str, user: str = SERVICE_USER) -> str:
    """The service's user in the system account's ``users``: it hears the callout requests and the
    agents' grant and release requests, reads the start commands of ``AIOS`` one by sequence, and
    publishes nothing else but its answers."""
    sub = ", ".join(json.dumps(s) for s in (AUTH_SUBJECT, grant_subject("*"), release_subject("*"), f"_INBOX.{user}.>"))
    pub = json.dumps(f"$JS.API.STREAM.MSG.GET.{subjects.STREAM}")
    return (f"{{user: {json.dumps(user)}, password: {json.dumps(password)}, permissions: {{publish: {{allow: [{pub}]}}, "
            f"subscribe: {{allow: [{sub}]}}, allow_responses: true}}}}")


def superseded(cmd: dict[str, Any], seq: int, later: list[tuple[int, str, dict[str, Any]]]) -> str | None:
    """Why the start command ``cmd`` (stored at ``seq``) no longer holds, given the stored events
    ``later`` (sequence, subject, data) after it: its block deleted (``block.deleted`` of its
    generation or a newer one), re-created (``block.parsed`` of another generation: a create refused
    for a live block has none), or the side-car stopped on that node (``node.sidecar.stop`` of the
    same block, generation and name). ``None``: it still holds (events of other blocks, side-cars or
    nodes, and the controller's ``parsed`` again of the same generation, change nothing)."""
    bid, name, node, gen = str(cmd.get("block_id")), cmd.get("name"), str(cmd.get("node_id")), int(cmd.get("gen") or 0)
    for at, subject, data in sorted(later, key=lambda e: e[0]):
        if at <= seq or data.get("block_id") != bid:
            continue
        other = int(data.get("gen") or 0)
        if subject == E.block_deleted.subject(bid=bid) and other >= gen:
            return f"block {bid!r} was deleted (sequence {at}) after the start command at sequence {seq}"
        if subject == E.block_parsed.subject(bid=bid) and other != gen:
            return (f"block {bid!r} was re-created (generation {other}, sequence {at}) after the start command of "
                    f"generation {gen} at sequence {seq}")
        if (subject == E.node_sidecar_stop.subject(nid=node) and data.get("name") == name and other == gen
                and data.get("node_id") == node):
            return (f"side-car {name!r} of block {bid!r} was stopped on node {node!r} (sequence {at}) after the "
                    f"start command at sequence {seq}")
    return None


# -- the service -----------------------------------------------------------------------------------
class SidecarAuthService:
    """Answers the server's auth callouts and the agents' grant and release requests (one service
    per registry file: it is the only writer)."""

    def __init__(self, nc: Any, registry: Registry, account: str = ACCOUNT) -> None:
        self.nc, self.reg, self.account = nc, registry, account
        self.refused: list[str] = []  # the latest reasons (tests, logs)
        self._subs: list[Any] = []

    async def start(self) -> None:
        self._subs = [await self.nc.subscribe(AUTH_SUBJECT, cb=self._on_auth),
                      await self.nc.subscribe(grant_subject("*"), cb=self._on_grant),
                      await self.nc.subscribe(release_subject("*"), cb=self._on_release)]
        await self.nc.flush()

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def authorize(self, request_jwt: str) -> str:
        """The signed answer to one ``$SYS.REQ.USER.AUTH`` request (decrypted)."""
        req = decode_jwt(request_jwt)["nats"]
        user_nkey, server_id = req["user_nkey"], req["server_id"]["id"]
        opts = req.get("connect_opts", {})
        try:
            bid, names = self.reg.check(opts.get("user", ""), opts.get("pass", ""))
        except PermissionError as exc:
            self.refused = [*self.refused[-99:], str(exc)]
            log.warning("sidecar_auth.refused", user=opts.get("user", ""), reason=str(exc),
                        host=req.get("client_info", {}).get("host"))
            return encode_jwt(response_claims(user_nkey, server_id, error=str(exc)), self.reg.seed.encode())
        user_jwt = encode_jwt(user_claims(user_nkey, bid, names, self.account), self.reg.seed.encode())
        log.info("sidecar_auth.granted", user=sidecar_user(bid), names=names)
        return encode_jwt(response_claims(user_nkey, server_id, user_jwt), self.reg.seed.encode())

    async def _on_auth(self, msg: Any) -> None:
        try:
            server_xkey = (msg.headers or {}).get(XKEY_HEADER, "")
            if server_xkey:  # encrypted to our xkey: the answer is encrypted to the server's
                request = unseal(msg.data, self.reg.xkey_private, server_xkey).decode()
                await msg.respond(seal(self.authorize(request).encode(), self.reg.xkey_private, server_xkey))
            else:
                await msg.respond(self.authorize(msg.data.decode()).encode())
        except Exception as exc:  # a malformed request: no answer (the server refuses the login)
            log.warning("sidecar_auth.bad_request", error=repr(exc))

    async def _answer(self, msg: Any, body: dict[str, Any]) -> None:
        if msg.reply.startswith("_INBOX."):  # an answer carries a password: only to an inbox
            await msg.respond(json.dumps(body).encode())

    async def _sent(self, node: str, bid: str, name: str, seq: int) -> None:
        """Whether the stored command ``seq`` started side-car ``name`` of ``bid`` on ``node``
        (``PermissionError`` saying why not): an agent may ask only for what it was sent."""
        if seq <= 0:
            raise PermissionError("no node.sidecar.start command named (seq)")
        try:
            stored = await self.nc.jetstream(timeout=5).get_msg(subjects.STREAM, seq)
        except Exception as exc:
            raise PermissionError(f"no stored command at sequence {seq} of {subjects.STREAM}: {exc!r}") from exc
        cmd: dict[str, Any] = {}
        if stored.subject == E.node_sidecar_start.subject(nid=node):
            cmd = json.loads(stored.data or b"{}").get("data") or {}
        if (cmd.get("block_id"), cmd.get("name"), cmd.get("node_id")) != (bid, name, node):
            raise PermissionError(f"sequence {seq} of {subjects.STREAM} does not start side-car {name!r} of block "
                                  f"{bid!r} on node {node!r}")
        later: list[tuple[int, str, dict[str, Any]]] = []
        for subject in (E.block_deleted.subject(bid=bid), E.block_parsed.subject(bid=bid),
                        E.node_sidecar_stop.subject(nid=node)):
            later += await self._after(subject, seq)
        if (why := superseded(cmd, seq, later)) is not None:
            raise PermissionError(why)

    async def _after(self, subject: str, seq: int) -> list[tuple[int, str, dict[str, Any]]]:
        """The stored events on ``subject`` after sequence ``seq`` (``next_by_subj``, one read each)."""
        js, found = self.nc.jetstream(timeout=5), list[tuple[int, str, dict[str, Any]]]()
        while True:
            try:
                msg = await js.get_msg(subjects.STREAM, seq + 1, subject=subject, next=True)
            except Exception as exc:  # none left (404), or the stream unreadable: then refuse, never grant blind
                if "no message found" in str(exc).lower() or getattr(exc, "code", None) == 404:
                    return found
                raise PermissionError(f"cannot read {subject} after sequence {seq} of {subjects.STREAM}: "
                                      f"{exc!r}") from exc
            seq = int(msg.seq or 0)
            found.append((seq, str(msg.subject), json.loads(msg.data or b"{}").get("data") or {}))

    async def _on_grant(self, msg: Any) -> None:
        node = msg.subject.split(".")[2]
        try:
            req = json.loads(msg.data or b"{}")
            bid, name = str(req["block_id"]), str(req["name"])
            if not (ID_RE.match(bid) and ID_RE.match(name)):
                raise ValueError(f"invalid block id or side-car name: {bid!r}, {name!r}")
            await self._sent(node, bid, name, int(req.get("seq") or 0))
            password = self.reg.grant(bid, name, node)
        except Exception as exc:
            self.refused = [*self.refused[-99:], str(exc)]
            log.warning("sidecar_auth.grant_refused", node=node, reason=str(exc))
            await self._answer(msg, {"error": str(exc)})
            return
        log.info("sidecar_auth.grant", node=node, block=bid, sidecar=name)
        await self._answer(msg, {"user": sidecar_user(bid), "password": password})

    async def _on_release(self, msg: Any) -> None:
        node = msg.subject.split(".")[2]
        try:
            released = self.reg.release(str(json.loads(msg.data or b"{}")["block_id"]), node)
        except Exception as exc:
            await self._answer(msg, {"error": str(exc)})
            return
        await self._answer(msg, {"released": released})


async def serve(url: str, state_dir: Path, stop: asyncio.Event, account: str = ACCOUNT) -> None:
    """``blocks sidecar-auth serve``: the service on ``url`` (its user in ``auth_users``) until ``stop``."""
    from ..bus.connection import connect

    nc = await connect(url, name="aios-sidecar-auth")
    svc = SidecarAuthService(nc, Registry.load(state_dir, create=False), account)
    await svc.start()
    log.info("sidecar_auth.serving", issuer=svc.reg.issuer, account=svc.account)
    try:
        await stop.wait()
    finally:
        await svc.stop()
        await nc.close()


# -- the agent's side ------------------------------------------------------------------------------
class CalloutSidecarUsers:
    """``SidecarUsers``'s interface for an agent on an external NATS (``AIOS_SIDECAR_AUTH=callout``):
    ``grant`` asks the service for the block's password and returns the side-car's URL (``base_url``
    with ``sidecar-<bid>`` and it); ``release`` tells it this node runs none of them any more.
    Called from a worker thread (``SidecarManager``); the requests run on the agent's loop."""

    def __init__(self, nc: Any, loop: asyncio.AbstractEventLoop, base_url: str, timeout: float = 5.0) -> None:
        self.nc, self.loop, self.base_url, self.timeout = nc, loop, base_url, timeout

    def _request(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        fut = asyncio.run_coroutine_threadsafe(self.nc.request(subject, json.dumps(body).encode(), timeout=self.timeout),
                                               self.loop)
        answer: dict[str, Any] = json.loads(fut.result(self.timeout + 1).data)
        if "error" in answer:
            raise RuntimeError(f"sidecar-auth refused: {answer['error']}")
        return answer

    def grant(self, bid: str, name: str, node: str, seq: int | None = None) -> str:
        """``seq``: the stream sequence of the ``node.sidecar.start`` command being run (default: the
        message whose handler is running, ``bus.router.TRIGGER_SEQ``, which ``asyncio.to_thread`` carries)."""
        from ..bus.router import TRIGGER_SEQ
        from .locate import with_userinfo

        seq = TRIGGER_SEQ.get() if seq is None else seq
        answer = self._request(grant_subject(node), {"block_id": bid, "name": name, "seq": seq})
        return ",".join(with_userinfo(u.strip(), answer["user"], answer["password"]) for u in self.base_url.split(","))

    def release(self, bid: str, node: str) -> bool:
        return bool(self._request(release_subject(node), {"block_id": bid})["released"])
