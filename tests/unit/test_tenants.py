"""Tenants' pure parts (docs/security.md "Tenants"): names, subjects, the generated accounts, the
parser's label, the desk's routing of events."""

from __future__ import annotations

import json

import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import parse
from aios_blocks.runtime import tenants as tn
from aios_blocks.workers import tenants as desk


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "a b", "t\n"])
def test_tenant_and_user_names_are_ids(bad: str) -> None:
    with pytest.raises(ValueError):
        tn.account(bad)
    with pytest.raises(ValueError):
        tn.user_name("ok", bad)


def test_a_tenants_users_never_collide_with_system_users_or_other_tenants() -> None:
    assert tn.user_name("team-a", "main") == "team-a.main"  # a dot: no role or agent-<nid> has one
    assert tn.user_name("a_b", "c") != tn.user_name("a", "b_c")


def test_the_account_imports_only_its_own_subjects_and_may_publish_only_requests() -> None:
    t = tn.Tenant("acme", {"main": "pw"}, tn.Limits(connections=5, stream_bytes=1000))
    conf = tn.accounts_conf(['      {user: "admin", password: "x"}'], [t, tn.Tenant("other", {"main": "pw2"})])
    mine = conf.split('"tenant-acme": {')[1].split('"tenant-other": {')[0]
    assert "aios.tenant.other" not in mine and "max_connections: 5" in mine and "max_file: 1000" in mine
    for r in tn.REQUESTS:
        assert f'subject: "{tn.import_subject("acme", r)}"}}, to: "aios.block.*.{r}"' in mine
    # a create goes to the desk, which stores it with its Nats-Msg-Id scoped to the tenant (workers.tenants)
    assert 'subject: "aios.tenant.acme.intake.*.create"}, to: "aios.block.*.create"' in mine
    assert 'subject: "aios.tenant.acme.event.block.>"' not in mine and '"aios.tenant.acme.event.>"' in mine
    perms = tn.user_permissions()
    assert '"aios.block.*.create"' in perms and "aios.block.*.ready" not in perms and '"aios.tenant' not in perms


def test_each_user_of_a_tenant_has_an_account_of_its_own_with_the_tenants_imports() -> None:
    """What one user publishes (its tasks) and its answers stay in its account: no other user of the
    tenant can subscribe to them or capture them with a stream (tests/integration/test_tenant_users.py)."""
    assert tn.account("acme") == tn.account("acme", "main") == "tenant-acme"  # the tenant's first account, as before
    assert tn.account("acme", "dash") == "tenant-acme.dash" != tn.account("acme-dash")
    t = tn.Tenant("acme", {"main": "pw", "dash": "pw2"}, tn.Limits(connections=5))
    conf = tn.accounts_conf([], [t])
    dash = conf.split('"tenant-acme.dash": {')[1].split('"tenant-acme": {')[0]
    main = conf.split('"tenant-acme": {')[1]
    assert 'user: "acme.dash"' in dash and "acme.main" not in dash and "max_connections: 2" in dash  # its share
    assert 'user: "acme.main"' in main and "acme.dash" not in main
    for r in tn.REQUESTS:
        assert f'subject: "{tn.import_subject("acme", r)}"}}, to: "aios.block.*.{r}"' in dash
    assert '{stream: {account: "AIOS", subject: "aios.tenant.acme.event.>"}, to: "aios.block.>"}' in dash
    assert tn.credentials("acme", "dash", "pw2", "nats://h:1", None)["account"] == "tenant-acme.dash"


def test_a_tenants_limits_are_split_across_its_users_accounts_and_add_up_to_its_own() -> None:
    """nats-server limits accounts one by one: each user's account gets a share, so the tenant's
    users together never get more than its operator set (tests/integration/test_tenant_limits.py)."""
    lim = tn.Limits(connections=5, stream_bytes=1001, memory_bytes=0, streams=4, consumers=64)
    t = tn.Tenant("acme", {"zed": "p", "main": "p", "dash": "p"}, lim)
    split = tn.shares(t)
    assert list(split) == ["main", "dash", "zed"]  # main first: the remainder one each from it
    assert [s["connections"] for s in split.values()] == [2, 2, 1]
    assert [s["stream_bytes"] for s in split.values()] == [334, 334, 333]
    assert [s["memory_bytes"] for s in split.values()] == [0, 0, 0]  # none for the tenant: none for each
    for name in tn.SPLIT:
        assert sum(s[name] for s in split.values()) == getattr(lim, name), name
    conf = tn.accounts_conf([], [t])
    assert conf.count("max_connections: 2") == 2 and conf.count("max_connections: 1") == 1
    assert "max_file: 334," in conf and "max_file: 333," in conf and "max_connections: 5" not in conf
    one = tn.accounts_conf([], [tn.Tenant("solo", {"main": "p"}, lim)])
    assert "max_connections: 5" in one and "max_file: 1001," in one  # one user: the whole of it
    row = tn.describe(t)
    assert row["limits"]["connections"] == 5 and row["fits"] is True
    assert row["shares"] == {"tenant-acme": split["main"], "tenant-acme.dash": split["dash"], "tenant-acme.zed": split["zed"]}


@pytest.mark.parametrize(("field", "flag", "total"), [("connections", "--max-connections", 2), ("streams", "--max-streams", 2),
                                                      ("consumers", "--max-consumers", 2),
                                                      ("stream_bytes", "--max-stream-bytes", 2)])
def test_a_limit_that_cannot_give_each_user_one_is_refused_naming_its_flag(field: str, flag: str, total: int) -> None:
    t = tn.Tenant("acme", {"main": "p", "a": "p", "b": "p"}, tn.Limits(**{field: total}))
    with pytest.raises(ValueError, match=f"{flag} {total} cannot give each of its 3 users") as refused:
        tn.check(t)
    assert f"blocks tenant add acme {flag} 3" in str(refused.value)
    assert tn.describe(t)["fits"] is False
    # a config written before (no check then) still gives every account at least 1: a 0 would read
    # as no limit (streams, consumers) or no connection at all
    assert all(s[field] >= 1 for s in tn.shares(t).values()) or field not in tn.AT_LEAST_ONE
    assert tn.check(tn.Tenant("acme", {"main": "p", "a": "p"}, t.limits)) is not None
    # bytes may be 0 for the tenant: none for each of its accounts
    assert tn.check(tn.Tenant("acme", {"main": "p", "a": "p", "b": "p"}, tn.Limits(stream_bytes=0))) is not None


def test_replayable_subjects_leave_out_every_request() -> None:
    assert "aios.block.*.ready" in tn.REPLAYABLE and "aios.block.*.instance.*.added" in tn.REPLAYABLE
    assert not {f"aios.block.*.{r}" for r in tn.REQUESTS} & set(tn.REPLAYABLE)


def test_a_tenants_create_is_labelled_with_its_name_and_may_not_name_another() -> None:
    out = parse.for_tenant(parse.ParseOutcome(doc={"blockComponentURI": "u", "labels": {"x": "1"}}), "acme")
    assert out.doc is not None and out.doc["labels"] == {"x": "1", "tenant": "acme"} and not out.errors
    same = parse.for_tenant(parse.ParseOutcome(doc={"labels": {"tenant": "acme"}}), "acme")
    assert same.doc is not None and not same.errors
    other = parse.for_tenant(parse.ParseOutcome(doc={"labels": {"tenant": "victim"}}), "acme")
    assert other.doc is None and other.errors[0].path == "$.labels.tenant" and "victim" in other.errors[0].message


def test_the_desk_relays_stored_block_events_only_and_knows_whose_create_it_was() -> None:
    assert desk.relayed("aios.block.b1.ready") is E.block_ready
    assert desk.relayed("aios.block.b1.instance.b1-0.added") is E.instance_added
    for not_an_event in ("aios.block.b1.task", "aios.block.b1.create", "aios.block.b1.dry_run.result", "aios.node.n.x"):
        assert desk.relayed(not_an_event) is None, not_an_event
    assert desk.tenant_of_create("aios.tenant.acme.block.b1.create") == "acme"
    assert desk.tenant_of_create("aios.block.b1.create") is None
    assert desk.block_tenant({"ir": {"labels": {"tenant": "acme"}}}) == "acme"
    assert desk.block_tenant({"ir": {"virtualClusterId": "v1"}}) is None  # a quota tenant, not an account's
    assert tn.event_subject("acme", "aios.block.b1.ready") == "aios.tenant.acme.event.b1.ready"


def _ev(gen: int | None = None, subject: str = "") -> bytes:
    data: dict[str, object] = {"block_id": "b1"}
    if gen is not None:
        data["gen"] = gen
    if subject:
        data["subject"] = subject
    return json.dumps({"specversion": "1.0", "data": data}).encode()


def test_history_owners_give_each_event_to_the_tenant_whose_create_made_it() -> None:
    """Block id b1: A's create (gen 10), B's refused create of the id (gen 20), A's block deleted,
    C's create (gen 30), a default-tenant create (gen 40) of the block now labelled C's (a quota
    group made a tenant); events without a gen go to the last create parsed before them."""
    owners = desk.HistoryOwners({"gen": "40", "ir": {"labels": {"tenant": "c"}}})
    submitted = [(1, 10, "aios.tenant.a.block.b1.create"), (5, 20, "aios.tenant.b.block.b1.create"),
                 (9, 30, "aios.tenant.c.block.b1.create"), (13, 40, "aios.block.b1.create")]
    for seq, gen, subject in submitted:
        owners.created(seq, E.block_submitted, _ev(gen, subject))
    for seq, gen in ((2, 10), (10, 30), (14, 40)):
        owners.created(seq, E.block_parsed, _ev(gen))
    assert [owners.owner(s, _ev(g)) for s, g in ((1, 10), (3, 10), (6, 20), (7, 10), (11, 30), (15, 40))] == \
        ["a", "a", "b", "a", "c", "c"]
    # without a gen: A's delete request (seq 8), C's decision (12); before any parse: nobody's
    assert [owners.owner(s, _ev()) for s in (8, 12, 16, 1)] == ["a", "c", "c", None]
    # a gen no create of the stream names (the stream lost it) that is not the block's now: nobody's
    assert owners.owner(20, _ev(99)) is None


def test_a_tenants_watch_shows_each_event_once_by_subject_and_id() -> None:
    """``bus.history.Once`` (``blocks watch -c``): the relay is core NATS and may pass one stored
    event twice (same subject, same CloudEvent id); a new id, or the same id on another subject, is
    a new event; an event without an id is always shown; only the last ``size`` keys are kept."""
    from aios_blocks.bus.history import Once

    once = Once(size=2)
    ready = {"id": "b1:1:ready", "data": {}}
    assert once.first("aios.block.b1.ready", ready) is True
    assert once.first("aios.block.b1.ready", dict(ready)) is False  # the relay's second delivery
    assert once.first("aios.block.b1.ready", {"id": "b1:2:ready"}) is True  # another generation's
    assert once.first("aios.block.b2.ready", ready) is True  # another subject
    assert once.first("aios.block.b1.ready", {"data": {}}) is True
    assert once.first("aios.block.b1.ready", {"data": {}}) is True  # no id: nothing to tell it by
    assert once.first("aios.block.b1.ready", ready) is True  # forgotten: two newer keys since


def test_only_a_split_that_shrinks_an_accounts_jetstream_share_reads_its_use() -> None:
    """``runtime.tenant_usage``: nats-server keeps an account's streams when its limits shrink, so
    such a split is checked against what the account holds (logged in as its user); raising a
    limit, or lowering connections only (the server closes those beyond it), reads nothing."""
    from aios_blocks.runtime import tenant_usage

    old = tn.Tenant("acme", {"main": "p", "dash": "p"}, tn.Limits(connections=8, streams=4))
    more = tn.Tenant("acme", {"main": "p", "dash": "p", "ops": "p"}, old.limits)
    assert tenant_usage.shrunk(more, old) == ["main", "dash"]  # the new user has no account yet
    assert tenant_usage.shrunk(tn.Tenant("acme", old.users, tn.Limits(connections=2)), old) == []
    assert tenant_usage.shrunk(tn.Tenant("acme", old.users, tn.Limits(stream_bytes=1 << 30)), old) == []
    assert tenant_usage.shrunk(tn.Tenant("acme", old.users, tn.Limits(streams=3)), old) == ["dash"]  # 2+2 -> 2+1
    assert tenant_usage.shrunk(old, tn.Tenant("acme", {})) == []  # a new tenant


def test_the_system_accounts_one_user_may_only_ask_an_accounts_jetstream_use() -> None:
    """``tenants.monitor_block``: while tenants exist, nats-server's system account gets one user,
    with which the admin side reads a tenant account's JetStream use without a connection of that
    account's (whose share may be all in use: tests/integration/test_tenant_limits.py)."""
    t = tn.Tenant("acme", {"main": "pw"})
    assert '"$SYS"' not in tn.accounts_conf([], [t]) and '"$SYS"' not in tn.accounts_conf([], [], "pw")
    conf = tn.accounts_conf([], [t], "sekret")
    block = conf.split('"$SYS": {')[1]
    assert 'user: "aios-monitor", password: "sekret"' in block
    assert 'publish: {allow: ["$SYS.REQ.SERVER.PING.JSZ"]}' in block and 'subscribe: {allow: ["_INBOX.aios-usage"]}' in block
    assert conf.rstrip().endswith("}") and conf.count("{") == conf.count("}")


def test_an_accounts_jsz_is_read_as_its_own_jetstream_info_would_say() -> None:
    """``tenant_usage.jsz_use``: the JSZ's ``reserved_*`` are the account's limits, so what its
    streams reserve is summed from their ``max_bytes``, by storage; streams and consumers counted."""
    from aios_blocks.runtime import tenant_usage

    data = {"storage": 10, "memory": 3, "reserved_storage": 1_000_000, "reserved_memory": 2**64 - 1, "stream_detail": [
        {"config": {"max_bytes": 1000, "storage": "file"}, "state": {"consumer_count": 0}},
        {"config": {"max_bytes": 5000, "storage": "file"}, "state": {"consumer_count": 2}},
        {"config": {"max_bytes": -1, "storage": "file"}, "state": {"consumer_count": 1}},
        {"config": {"max_bytes": 700, "storage": "memory"}, "state": {}}]}
    assert tenant_usage.jsz_use(data) == {"storage": 10, "memory": 3, "reserved_storage": 6000, "reserved_memory": 700,
                                          "streams": 4, "consumers": 3}
    assert tenant_usage.jsz_use({}) == {"storage": 0, "memory": 0, "reserved_storage": 0, "reserved_memory": 0,
                                        "streams": 0, "consumers": 0}


def test_a_server_without_the_monitor_user_is_read_as_the_accounts_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose config predates ``tenants.MONITOR_USER`` refuses its login: the account's use
    is then read as its own user (as before); any other failure is not hidden."""
    from aios_blocks.runtime import tenant_usage

    t = tn.Tenant("acme", {"main": "pw"})
    asked: list[str] = []

    def jsz(url: str, account: str, ca: str | None) -> dict[str, int]:
        asked.append(f"jsz {account}")
        raise RuntimeError("nats-server refused 'aios-monitor': -ERR 'Authorization Violation'")

    def info(url: str, ca: str | None) -> dict[str, int]:
        asked.append(url.split("@")[0])
        return {"streams": 1}

    monkeypatch.setattr(tenant_usage, "account_jsz", jsz)
    monkeypatch.setattr(tenant_usage, "account_info", info)
    assert tenant_usage._use(t, "main", "nats://127.0.0.1:4222", None, "secret") == {"streams": 1}
    assert asked == ["jsz tenant-acme", "nats://acme.main:pw"]
    asked.clear()
    assert tenant_usage._use(t, "main", "nats://127.0.0.1:4222", None, None) == {"streams": 1}
    assert asked == ["nats://acme.main:pw"]  # no password: as before

    def down(url: str, account: str, ca: str | None) -> dict[str, int]:
        raise RuntimeError("nats-server closed the connection of 'aios-monitor' before answering")

    monkeypatch.setattr(tenant_usage, "account_jsz", down)
    with pytest.raises(RuntimeError, match="before answering"):
        tenant_usage._use(t, "main", "nats://127.0.0.1:4222", None, "secret")
