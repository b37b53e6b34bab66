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
        assert f'subject: "aios.tenant.acme.block.*.{r}"}}, to: "aios.block.*.{r}"' in mine
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
    assert 'user: "acme.dash"' in dash and "acme.main" not in dash and "max_connections: 5" in dash
    assert 'user: "acme.main"' in main and "acme.dash" not in main
    for r in tn.REQUESTS:
        assert f'subject: "aios.tenant.acme.block.*.{r}"}}, to: "aios.block.*.{r}"' in dash
    assert '{stream: {account: "AIOS", subject: "aios.tenant.acme.event.>"}, to: "aios.block.>"}' in dash
    assert tn.credentials("acme", "dash", "pw2", "nats://h:1", None)["account"] == "tenant-acme.dash"


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
