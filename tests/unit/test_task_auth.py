"""Credentials on the executors' HTTP port (``executor.task_auth``, ``runtime.task_users``): the
users file holds salted hashes of exactly the users that may send tasks over NATS, the Basic header
is parsed strictly, a tenant's user is held to its tenant's blocks, and the file is read again when
it changes. (On real servers: tests/integration/test_executor_http_auth.py.)"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from aios_blocks.executor.engine import Refused
from aios_blocks.executor.task_auth import TaskUsers, User, authenticate, authorize, basic, parse_users
from aios_blocks.runtime import task_users

NATS = {"admin": "pw-admin", "upstream": "pw-up", "observer": "pw-obs", "parser": "pw-parser"}
TENANTS = {"ta": {"users": {"main": "pw-ta", "two": "pw-ta2"}}, "tb": {"users": {"main": "pw-tb"}}}


def header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def users(tmp_path: Path) -> dict[str, User]:
    path = task_users.write(tmp_path / "secrets.json", NATS, TENANTS)
    return parse_users(json.loads(path.read_text()))


def test_the_file_holds_hashes_of_the_task_users_only(tmp_path: Path) -> None:
    path = task_users.write(tmp_path / "secrets.json", NATS, TENANTS)
    assert path == tmp_path / "task-users.json" and oct(path.stat().st_mode & 0o777) == "0o600"
    text = path.read_text()
    assert sorted(json.loads(text)["users"]) == ["admin", "ta.main", "ta.two", "tb.main", "upstream"]
    assert not any(pw in text for pw in [*NATS.values(), "pw-ta", "pw-ta2", "pw-tb"])
    got = parse_users(json.loads(text))
    assert got["ta.two"].tenant == "ta" and got["upstream"].tenant is None


def test_basic_credentials_are_read_strictly() -> None:
    assert basic(header("upstream", "a:b")) == ("upstream", "a:b")  # the password may hold a colon
    assert basic("basic " + base64.b64encode(b"u:p").decode()) == ("u", "p")
    for bad in (None, "", "Bearer x", "Basic", "Basic !!!", "Basic " + base64.b64encode(b"no-colon").decode()):
        assert basic(bad) is None, bad


def test_right_wrong_and_missing_credentials(tmp_path: Path) -> None:
    u = users(tmp_path)
    who = authenticate(u, header("upstream", "pw-up"))
    assert isinstance(who, User) and who.name == "upstream"
    for h in (None, header("upstream", "pw-admin"), header("nobody", "pw-up"), header("observer", "pw-obs"),
              header("parser", "pw-parser")):
        r = authenticate(u, h)
        assert isinstance(r, Refused) and r.status == 401
        assert "pw-" not in r.reason  # never echoes a password


def test_a_tenants_user_may_task_only_its_tenants_blocks(tmp_path: Path) -> None:
    u = users(tmp_path)
    assert authorize(u["upstream"], "b1", "ta") is None and authorize(u["admin"], "b1", None) is None
    assert authorize(u["ta.two"], "b1", "ta") is None
    for user, tenant in (("ta.main", "tb"), ("ta.main", None), ("tb.main", "ta")):
        r = authorize(u[user], "b1", tenant)
        assert r is not None and r.status == 403 and user in r.reason
    # said plainly: "tenant 'ta''s blocks" read as one odd quote
    r = authorize(u["ta.main"], "b1", "tb")
    assert r is not None and r.reason == ("user 'ta.main' may send tasks only to the blocks of tenant 'ta', "
                                          "and block 'b1' is not one of them")


def test_the_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.json"
    task_users.write(secrets, NATS, {})
    tu = TaskUsers(str(tmp_path / "task-users.json"))
    assert "ta.main" not in tu.users()
    task_users.write(secrets, NATS, TENANTS)
    assert "ta.main" in tu.users()
    os.remove(tmp_path / "task-users.json")
    assert tu.users() == {}  # unreadable: nobody is let in
    (tmp_path / "task-users.json").write_text("{not json")
    assert tu.users() == {}


def test_the_file_is_written_with_the_secrets_and_for_a_data_dir_made_before_it(tmp_path: Path) -> None:
    from aios_blocks.runtime.auth import Secrets

    auth_dir = tmp_path / "auth"
    auth_dir.mkdir()
    (auth_dir / "secrets.json").write_text(json.dumps({"nats": NATS, "tenants": {}}))  # no task-users.json yet
    assert task_users.sync(tmp_path) == task_users.path(tmp_path)  # what blocks up does at start
    tu = TaskUsers(str(task_users.path(tmp_path)))
    assert sorted(tu.users()) == ["admin", "upstream"]
    s = Secrets.load(tmp_path)  # a tenant user added by any process: written with the secrets
    s.tenants = TENANTS
    s.save()
    assert "ta.two" in tu.users() and tu.users()["ta.two"].tenant == "ta"
    os.remove(task_users.path(tmp_path))
    Secrets.load(tmp_path).save()  # a file removed is written again
    assert "ta.two" in TaskUsers(str(task_users.path(tmp_path))).users()
    assert task_users.sync(tmp_path / "none") is None  # no secrets: nothing
