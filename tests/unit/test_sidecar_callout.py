"""The auth callout service's parts without a server (runtime/sidecar_callout.py): the JWTs it
writes, the registry of blocks' passwords and names, the answers, `blocks sidecar-auth init`."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path

import nacl.exceptions
import nkeys
import pytest
from typer.testing import CliRunner

from aios_blocks.cli.app import app
from aios_blocks.runtime import sidecar_callout as sc
from aios_blocks.runtime.sidecar_users import sidecar_permissions


def _server() -> tuple[bytes, str]:
    seed = bytes(nkeys.encode_seed(b"\x07" * 32, nkeys.PREFIX_BYTE_SERVER))
    return seed, nkeys.from_seed(seed).public_key.decode()


def test_a_jwt_is_nats_shaped_and_its_signature_is_checked() -> None:
    seed = sc.new_account_seed()
    token = sc.encode_jwt({"sub": "U", "nats": {"type": "user"}}, seed)
    head, payload, _ = token.split(".")
    assert "=" not in token and json.loads(sc._unb64(head)) == {"typ": "JWT", "alg": "ed25519-nkey"}
    claims = sc.decode_jwt(token)
    assert claims["iss"] == nkeys.from_seed(seed).public_key.decode() and claims["iss"].startswith("A")
    body = {k: v for k, v in json.loads(sc._unb64(payload)).items() if k != "jti"}
    want = base64.b32encode(hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).digest()).decode().rstrip("=")
    assert claims["jti"] == want
    forged = sc._b64(json.dumps({**claims, "sub": "V"}, separators=(",", ":")).encode())
    with pytest.raises(nkeys.ErrInvalidSignature):
        sc.decode_jwt(f"{head}.{forged}.{token.split('.')[2]}")


def test_sealed_messages_open_only_for_their_recipient_from_their_sender() -> None:
    a, b, c = (bytes([n]) * 32 for n in (1, 2, 3))
    box = sc.seal(b"secret", a, sc.xkey_public(b))
    assert box.startswith(b"xkv1") and b"secret" not in box and sc.xkey_public(a).startswith("X")
    assert sc.unseal(box, b, sc.xkey_public(a)) == b"secret"
    with pytest.raises(nacl.exceptions.CryptoError):
        sc.unseal(box, c, sc.xkey_public(a))
    with pytest.raises(ValueError, match="not an xkey"):
        sc.seal(b"x", a, nkeys.from_seed(sc.new_account_seed()).public_key.decode())


def test_the_registry_grants_checks_and_forgets(tmp_path: Path) -> None:
    reg = sc.Registry.load(tmp_path / "s")
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    assert stat.S_IMODE(reg.path.stat().st_mode) == 0o600
    pw = reg.grant("b1", "store", "n1")
    assert reg.grant("b1", "alert", "n2") == pw and sc.Registry.load(tmp_path / "s").blocks["b1"]["names"] == ["alert", "store"]
    assert reg.check("sidecar-b1", pw) == ("b1", ["alert", "store"])
    for user, password, why in (("sidecar-b1", "x", "wrong password"), ("sidecar-b2", pw, "no running block"),
                                ("agent-n1", pw, "no running block"), ("", "", "no user name"),
                                ("sidecar-b1.>", pw, "no running block")):
        with pytest.raises(PermissionError, match=why):
            reg.check(user, password)
    reg.grant("a", "b-x", "n1")
    with pytest.raises(ValueError, match="is block a's already"):
        reg.grant("a-b", "x", "n1")
    assert reg.release("b1", "n1") is False and reg.release("b1", "n2") is True
    with pytest.raises(PermissionError):
        reg.check("sidecar-b1", pw)


def test_the_answer_carries_the_blocks_sidecar_rights_or_the_reason(tmp_path: Path) -> None:
    reg = sc.Registry.load(tmp_path)
    pw = reg.grant("b1", "store", "n1")
    svc = sc.SidecarAuthService(None, reg)
    server_seed, server_id = _server()
    user_nkey = nkeys.from_seed(bytes(nkeys.encode_seed(b"\x01" * 32, nkeys.PREFIX_BYTE_USER))).public_key.decode()

    def ask(opts: dict[str, str]) -> dict[str, object]:
        req = {"sub": user_nkey, "aud": "nats-authorization-request",
               "nats": {"server_id": {"id": server_id, "name": "x"}, "user_nkey": user_nkey, "connect_opts": opts,
                        "type": "authorization_request", "version": 2}}
        answer = sc.decode_jwt(svc.authorize(sc.encode_jwt(req, server_seed)))
        assert answer["iss"] == reg.issuer and answer["aud"] == server_id and answer["sub"] == user_nkey
        return answer["nats"]  # type: ignore[no-any-return]

    ok = ask({"user": "sidecar-b1", "pass": pw})
    user = sc.decode_jwt(str(ok["jwt"]))
    perms = sidecar_permissions("b1", ["store"])
    assert user["aud"] == "AIOS" and user["name"] == "sidecar-b1" and user["sub"] == user_nkey
    assert user["nats"]["pub"]["allow"] == list(perms.publish) and user["nats"]["sub"]["allow"] == list(perms.subscribe)
    assert "jwt" not in ask({"user": "sidecar-b1", "pass": "no"}) and svc.refused[-1] == "wrong password for 'sidecar-b1'"


def test_init_prints_the_config_and_keeps_the_issuer(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["sidecar-auth", "init", "--state-dir", str(tmp_path / "s")])
    assert out.exit_code == 0, out.output
    issuer = sc.Registry.load(tmp_path / "s", create=False).issuer
    assert f"issuer: {issuer}" in out.output and "allowed_accounts: [ AIOS_SIDECAR_CALLOUT ]" in out.output
    xkey = sc.xkey_public(sc.Registry.load(tmp_path / "s").xkey_private)
    assert f"xkey: {xkey}" in out.output
    again = CliRunner().invoke(app, ["sidecar-auth", "init", "--state-dir", str(tmp_path / "s")])
    assert f"issuer: {issuer}" in again.output
    refused = CliRunner().invoke(app, ["sidecar-auth", "serve", "--state-dir", str(tmp_path / "none")],
                                 env={"AIOS_NATS_URL": "nats://x:y@127.0.0.1:1"})
    assert refused.exit_code == 2 and "sidecar-auth init" in refused.output


def test_superseded_says_which_later_event_undid_a_start_command() -> None:
    cmd = {"block_id": "b", "gen": 3, "node_id": "n1", "name": "store"}
    deleted, parsed, stop = "aios.block.b.deleted", "aios.block.b.parsed", "aios.node.n1.sidecar.stop"
    still = [(9, deleted, {"block_id": "b", "gen": 3}),  # before the start (seq 10)
             (11, deleted, {"block_id": "b", "gen": 2}),  # an older generation's
             (12, parsed, {"block_id": "b", "gen": 3}),  # back to selection, same generation
             (13, stop, {"block_id": "b", "gen": 3, "node_id": "n1", "name": "alert"}),  # another side-car
             (14, stop, {"block_id": "b", "gen": 2, "node_id": "n1", "name": "store"}),  # another generation's
             (15, "aios.block.c.deleted", {"block_id": "c", "gen": 3})]  # another block
    assert sc.superseded(cmd, 10, still) is None
    for event, why in (((20, deleted, {"block_id": "b", "gen": 3}), "block 'b' was deleted (sequence 20)"),
                       ((20, deleted, {"block_id": "b", "gen": 4}), "block 'b' was deleted"),
                       ((20, parsed, {"block_id": "b", "gen": 4}), "re-created (generation 4, sequence 20)"),
                       ((20, stop, {"block_id": "b", "gen": 3, "node_id": "n1", "name": "store"}),
                        "side-car 'store' of block 'b' was stopped on node 'n1' (sequence 20)")):
        assert why in (sc.superseded(cmd, 10, [*still, event]) or ""), event
