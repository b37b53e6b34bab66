"""Permissions derived from the subject catalog, config generation, secrets files and masking."""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

import pytest

from aios_blocks.bus import subjects
from aios_blocks.bus.nats_bus import security_options
from aios_blocks.runtime import auth
from aios_blocks.runtime import tenants as tn
from aios_blocks.runtime.embedded import nats_binary

matches = subjects.matches  # NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens


def allowed(role: str, subject: str, node: str | None = None) -> bool:
    perms = auth.permissions(role, node)
    if perms is None:
        return True
    return any(matches(p, subject) for p in perms.publish) and not any(matches(p, subject) for p in perms.deny_publish)


def example(pattern: str) -> str:
    """``aios.block.{bid}.instance.{iid}.added`` -> ``aios.block.b1.instance.b1.added``."""
    return re.sub(r"\{[a-z_]+\}", "b1", pattern).replace("{subject}", "aios.block.b1.create")


def test_matcher() -> None:
    assert matches("aios.block.*.create", "aios.block.b.create")
    assert not matches("aios.block.*.create", "aios.block.b.c.create")
    assert matches("aios.dlq.parser.>", "aios.dlq.parser.aios.block.b.create")
    assert not matches("aios.dlq.parser.>", "aios.dlq.parser")


def test_every_catalog_publisher_may_publish_its_subjects() -> None:
    seen = set()
    for pattern, role in auth._catalog_publishers():
        seen.add(role)
        if role == "agent":
            assert allowed("agent", example(pattern).replace("node.b1", "node.n1"), "n1"), pattern
            assert allowed("agent-sim", example(pattern)), pattern
        else:
            assert allowed(role, example(pattern)), (role, pattern)
    assert {"upstream", "parser", "gateway", "controller", "agent"} <= seen


def test_the_controllers_re_selection_right_comes_from_the_catalog() -> None:
    """A gang that no longer fits goes back to selection: the controller publishes ``parsed``."""
    (publishers,) = [p for s, p, _ in subjects.catalog() if s == "aios.block.{bid}.parsed"]
    assert {n.strip() for n in publishers.split("/")} == {"parser", "controller"}
    assert not auth.CATALOG_GAPS
    assert allowed("controller", "aios.block.b1.parsed") and allowed("parser", "aios.block.b1.parsed")
    assert not allowed("gateway", "aios.block.b1.parsed")


def test_every_catalog_role_maps_to_nats_users() -> None:
    from aios_blocks.bus.catalog import EVENTS, Role

    assert set(auth.ROLE_USERS) == set(Role)
    assert {r for e in EVENTS for r in e.publishers} <= set(auth.ROLE_USERS)


def test_upstream_publishes_only_creates_and_tasks_and_reads_only_its_inbox() -> None:
    perms = auth.permissions("upstream")
    assert perms is not None
    assert perms.publish == ("aios.block.*.create", "aios.block.*.task") and perms.subscribe == ("_INBOX.upstream.>",)
    assert not perms.allow_responses


def test_the_executor_answers_tasks_and_keeps_the_instance_maps_only() -> None:
    perms = auth.permissions("executor")
    assert perms is not None and perms.allow_responses
    assert "aios.block.*.task" in perms.subscribe
    # its events: the activator's request for a first instance of a block at zero, and the task
    # outputs for side-cars (docs/sidecars.md); nothing else
    assert sorted(p for p in perms.publish if p.startswith("aios.") and not p.startswith("aios.dlq.mapper.")) == \
        ["aios.block.*.scale.target", "aios.output.*.*"]
    assert "$KV.aios-instances.>" in perms.publish
    assert not [p for p in perms.publish if "CONSUMER" in p and ".AIOS." in p and "mapper" not in p and "INFO" not in p]


def test_a_node_agent_publishes_only_its_own_node() -> None:
    perms = auth.permissions("agent", "n1")
    assert perms is not None
    for p in perms.publish:
        if p.startswith("aios.node."):
            assert p.split(".")[2] == "n1", p
        else:
            assert p.startswith(("aios.block.*.instance.*.", "$JS.", "aios.dlq.agent-n1.")), p
    for subject in ("aios.node.n2.registered", "aios.node.n1.instance.create", "aios.node.n1.health", "aios.block.b.ready",
                    "aios.block.b.create", "$JS.API.CONSUMER.DURABLE.CREATE.AIOS.agent-n2", "$JS.API.STREAM.DELETE.AIOS",
                    "$JS.ACK.AIOS.parser.1.1.1.1.1"):
        assert not allowed("agent", subject, "n1"), subject
    assert perms.subscribe == ("_INBOX.agent-n1.>",)


def test_only_the_controller_answers_requests_and_observers_write_nothing() -> None:
    for role in ("parser", "agent-sim", "upstream", "observer"):
        perms = auth.permissions(role)
        assert perms is not None and not perms.allow_responses, role
    # the gateway answers tenants' requests (workers.tenants), which reach it only through their
    # accounts' service imports (the server names the reply subject) or from the admin
    gw = auth.permissions("gateway")
    assert gw is not None and gw.allow_responses and "aios.tenant.*.block.*.task" in gw.subscribe
    # it takes a tenant's create where the server hands it (the desk) and stores it in AIOS_INTAKE,
    # its Nats-Msg-Id scoped to the tenant; it publishes no other tenant subject but the relayed events
    assert "aios.tenant.*.intake.*.create" in gw.subscribe
    assert [p for p in gw.publish if p.startswith("aios.tenant.") and ".event." not in p] == ["aios.tenant.*.block.*.create"]
    # the upstream may not store a create as a tenant's (only the desk does, with the tenant's scoped id)
    upstream = auth.permissions("upstream")
    assert upstream is not None and not [p for p in upstream.publish if p.startswith("aios.tenant.")]
    obs = auth.permissions("observer")
    assert obs is not None and not [p for p in obs.publish if p.startswith("aios.")]
    # observers keep consumers of their own (durable or ephemeral, pull or push), named after their user ...
    for subject in ("$JS.API.CONSUMER.DURABLE.CREATE.AIOS.observer_1", "$JS.API.CONSUMER.CREATE.AIOS.observer_2.aios.block.>",
                    "$JS.API.CONSUMER.CREATE.AIOS.observer_3", "$JS.API.CONSUMER.MSG.NEXT.AIOS.observer_4",
                    "$JS.ACK.AIOS.observer_5.1.2.3.4.5", "$JS.API.CONSUMER.DELETE.AIOS.observer_6"):
        assert allowed("observer", subject), subject
    # ... always named: the unnamed create names its consumer in the body, out of the permissions' sight
    assert not allowed("observer", "$JS.API.CONSUMER.CREATE.AIOS")
    # ... and never touch a worker's (taking or acking its messages would suppress events) nor
    # another observer's: only their info, for a worker's
    for durable in (*auth.WORKER_DURABLES, "dash", "observer-x_1"):
        for subject in (f"$JS.API.CONSUMER.MSG.NEXT.AIOS.{durable}", f"$JS.ACK.AIOS.{durable}.1.2.3.4.5",
                        f"$JS.API.CONSUMER.DELETE.AIOS.{durable}", f"$JS.API.CONSUMER.DURABLE.CREATE.AIOS.{durable}",
                        f"$JS.API.CONSUMER.CREATE.AIOS.{durable}", f"$JS.API.CONSUMER.CREATE.AIOS.{durable}.aios.>"):
            assert not allowed("observer", subject), subject
    extra = auth.permissions("observer", protected=["agent-n1", "controller-c1"])
    assert extra is not None and "$JS.API.CONSUMER.INFO.AIOS.agent-n1" in extra.publish
    assert "$JS.API.CONSUMER.INFO.AIOS.controller-c1" in extra.publish and not [p for p in extra.publish if "agent-n1" in p
                                                                                and "INFO" not in p]


@pytest.mark.parametrize("role", ["parser", "gateway", "agent-sim"])
def test_workers_create_and_pull_only_their_own_consumers(role: str) -> None:
    own = {"parser": "parser", "gateway": "gateway", "agent-sim": "agent-sim"}[role]
    # the parser's durable is on AIOS_INTAKE (the creates as sent), the others' on AIOS
    st = "AIOS_INTAKE" if role == "parser" else "AIOS"
    assert allowed(role, f"$JS.API.CONSUMER.MSG.NEXT.{st}.{own}")
    assert allowed(role, f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.{own}")
    assert role == "parser" or not allowed(role, "$JS.API.CONSUMER.MSG.NEXT.AIOS_INTAKE.parser")
    for other in ("parser", "gateway", "controller", "lifecycle", "agent-sim"):
        if other != own:
            assert not allowed(role, f"$JS.API.CONSUMER.MSG.NEXT.AIOS.{other}")
            assert not allowed(role, f"$JS.API.CONSUMER.DURABLE.CREATE.AIOS.{other}")
    for api in ("STREAM.CREATE.AIOS", "STREAM.UPDATE.AIOS", "STREAM.DELETE.AIOS", "STREAM.PURGE.AIOS"):
        assert not allowed(role, f"$JS.API.{api}")


@pytest.mark.parametrize("nid", ["a.b", "*", ">", "", "a b", "n1\n", "{n}"])
def test_agent_users_need_a_valid_node_id(nid: str) -> None:
    with pytest.raises(ValueError):
        auth.agent_user(nid)


def test_generated_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    s = auth.Secrets.load(tmp_path)
    s.add_agent("gpu-7")
    s.tenants["team-a"] = tn.Tenant("team-a", {"main": "pw1", "dash": "pw2"}, tn.Limits(connections=3)).to_dict()
    conf = tmp_path / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:-1"\njetstream {{store_dir: "{tmp_path}/js"}}\n{auth.nats_authorization(s)}')
    r = subprocess.run([nats_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    text = conf.read_text()
    for role in auth.ROLES:
        assert f'user: "{role}"' in text
    assert 'user: "agent-gpu-7"' in text and '"aios.node.gpu-7.registered"' in text
    # the tenant: an account of its own, its users, limits, and imports of its own subjects only
    assert '"tenant-team-a": {' in text and 'user: "team-a.main"' in text and 'user: "team-a.dash"' in text
    # the tenant's 3 connections split across its two users' accounts (docs/security.md "Per-tenant limits")
    assert "max_connections: 2" in text and "max_connections: 1" in text and "max_connections: 3" not in text
    assert '"aios.tenant.team-a.intake.*.create"' in text
    assert "aios.tenant.*" not in text.split('"tenant-team-a": {')[1]
    assert '"tenant-team-a.dash": {' in text  # each further user: an account of its own


def test_redis_acl_turns_the_default_user_off(tmp_path: Path) -> None:
    s = auth.Secrets.load(tmp_path)
    lines = auth.redis_acl(s).splitlines()
    # off: nobody logs in as it; all permissions: Redis 7.0 replays the AOF as `default`, and MULTI/EXEC
    # of a user without them is dropped on restart (tests/integration/test_lifecycle.py proves the restart)
    assert lines[0] == "user default off ~* &* +@all"
    assert f"user aios on >{s.redis['aios']} ~aios:* &* +@all -@dangerous" in lines
    assert any(line.startswith("user observer on ") and "+@read" in line and "+@write" not in line for line in lines)


def test_secrets_are_private_and_stable(tmp_path: Path) -> None:
    s = auth.Secrets.load(tmp_path)
    assert stat.S_IMODE(s.path.stat().st_mode) == 0o600 and stat.S_IMODE(s.path.parent.stat().st_mode) == 0o700
    again = auth.Secrets.load(tmp_path)
    assert again.nats == s.nats and again.redis == s.redis
    # one secret per role, and the system account's user's (it reads tenants' JetStream use)
    assert len(set(s.nats.values())) == len(auth.ROLES) + 1 and tn.MONITOR_USER in s.nats
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{32}", v) for v in [*s.nats.values(), *s.redis.values()])
    assert s.add_agent("n1") and not s.add_agent("n1")
    assert json.loads(s.path.read_text())["agents"]["n1"] == s.agents["n1"]


def test_endpoints_give_each_worker_its_role(tmp_path: Path) -> None:
    s = auth.Secrets.load(tmp_path)
    ep = auth.Endpoints("nats://127.0.0.1:4", "redis://127.0.0.1:5/0", True, tmp_path)
    assert ep.env("gateway") == {
        "AIOS_NATS_URL": f"nats://gateway:{s.nats['gateway']}@127.0.0.1:4",
        "AIOS_REDIS_URL": f"redis://aios:{s.redis['aios']}@127.0.0.1:5/0",
        "AIOS_EVENT_KEY": s.event_key,  # the system's wire-id key (bus/event_ids.py)
    }
    assert len(s.event_key) == 64 and auth.Secrets.load(tmp_path).event_key == s.event_key  # made once, kept
    assert ep.redis_url("upstream") is None and ep.redis_url("observer").startswith("redis://observer:")  # type: ignore[union-attr]
    assert ep.env("something-new") == {}  # unknown kinds keep the URL the supervisor was given
    assert "@" not in json.dumps(ep.public())
    with pytest.raises(LookupError):
        ep.nats_url("agent", "nope")


def test_mask_hides_passwords_only() -> None:
    assert auth.mask("NATS nats://admin:s3cr3t@127.0.0.1:4 and redis://aios:x-y_z@h:5/0") == (
        "NATS nats://admin:***@127.0.0.1:4 and redis://aios:***@h:5/0"
    )
    assert auth.mask("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert auth.mask("redis://:onlypass@h:1") == "redis://:***@h:1"
    assert auth.url_user("nats://u:p@h:1,nats://v:q@h:2") == "u" and auth.url_user("nats://h:1") is None


def test_connection_options_follow_the_url_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from aios_blocks.settings import Settings

    monkeypatch.delenv("AIOS_NATS_CA", raising=False)
    monkeypatch.delenv("AIOS_NATS_CREDS", raising=False)
    plain = Settings()
    assert security_options("nats://h:1", settings=plain) == {}
    assert security_options("nats://gateway:pw@h:1,nats://gateway:pw@h:2", settings=plain) == {"inbox_prefix": "_INBOX.gateway"}
    monkeypatch.setenv("AIOS_NATS_CREDS", "/x/user.creds")  # read when the settings are built
    assert security_options("nats://h:1", settings=Settings())["user_credentials"] == "/x/user.creds"


def test_auth_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOS_AUTH", raising=False)
    monkeypatch.delenv("AIOS_NATS_TLS", raising=False)
    assert auth.auth_enabled() and not auth.tls_enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv("AIOS_AUTH", off)
        assert not auth.auth_enabled()
    monkeypatch.setenv("AIOS_NATS_TLS", "1")
    assert auth.tls_enabled()


def test_a_sidecar_consumes_outputs_and_dead_letters_them_only() -> None:
    perms = auth.permissions("sidecar")
    assert perms is not None and not perms.allow_responses
    assert perms.subscribe == ("_INBOX.sidecar.>",)
    aios = [p for p in perms.publish if p.startswith("aios.")]
    # its dead letters stay with the outputs in AIOS_OUTPUTS (catalog output.dlq), not in AIOS
    assert sorted(aios) == ["aios.block.*.sidecar.*.alert", "aios.output.*.dlq.*.*"]
    js = [p for p in perms.publish if p.startswith("$JS")]
    assert js and all(".AIOS_OUTPUTS." in p for p in js)  # nothing of the control stream
    agent = auth.permissions("agent", "n1")
    assert agent is not None and "$JS.API.CONSUMER.DELETE.AIOS_OUTPUTS.*" in agent.publish


def test_observers_may_not_join_a_queue_group() -> None:
    obs = auth.permissions("observer")
    assert obs is not None and obs.deny_subscribe == ("aios.> *", *auth.TASK_DATA)
    assert 'subscribe: {allow: [' in obs.conf() and 'deny: ["aios.> *", "aios.block.*.task", ' in obs.conf()
    for role in ("parser", "controller", "executor", "agent-sim", "upstream"):
        perms = auth.permissions(role)
        assert perms is not None and perms.deny_subscribe == (), role


def test_task_data_is_denied_to_observers_and_the_gateways_relay() -> None:
    """docs/security.md "Tasks and outputs are not events": the denied subjects come from the
    catalog; an observer may subscribe to every event through any wildcard (NATS filters the denied
    subjects out of its deliveries: tests/integration/test_task_privacy.py), never to task data."""
    from aios_blocks.bus.catalog import EVENTS, E
    from aios_blocks.bus.subjects import matches

    assert auth.TASK_DATA == (E.block_task.filter(), E.tenant_block_task.filter(), E.block_output.filter(),
                              E.output_dead_letter.filter(), "aios.dlq.*.aios.output.>")
    # every stored one is in AIOS_OUTPUTS, where observers have no JetStream right
    assert {e.stream for e in auth.TASK_DATA_EVENTS if e.stored} == {"AIOS_OUTPUTS"}
    obs = auth.permissions("observer")
    assert obs is not None
    assert [p for p in obs.publish if "AIOS_OUTPUTS" in p] == ["$JS.API.STREAM.INFO.AIOS_OUTPUTS"]  # no consumer, no get
    for denied in auth.TASK_DATA:
        assert denied in obs.deny_subscribe, denied
    allowed = lambda s: any(matches(a, s) for a in obs.subscribe)  # noqa: E731  (a subscription's subject, wildcards as tokens)
    for s in ("aios.>", "aios.block.>", "aios.block.b1.>", "aios.output.>", "aios.node.>", "aios.node.n1.>", "aios.block.b1.ready"):
        assert allowed(s), s
    for e in EVENTS:
        if e.filter() not in auth.TASK_DATA:
            assert allowed(e.filter()) and allowed(e.subject(**{t: "x" for t in e.tokens})), e.name
    gw = auth.permissions("gateway")
    assert gw is not None and gw.deny_subscribe == ("aios.block.*.task",)
