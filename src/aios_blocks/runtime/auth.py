"""Credentials and permissions of the embedded servers (see docs/security.md).

One NATS user per role, each with publish/subscribe allow lists; one user per real node agent
(``agent-<nid>``, added on demand and loaded with a config reload); Redis ACL users. Secrets are
random, kept in ``<data dir>/auth/secrets.json`` (0600, in a 0700 directory) and reused across
restarts; ``endpoints.json`` carries URLs without credentials.

Publish permissions are derived from the one event catalog (``bus.catalog``: its
"published by" column), so a subject added there with its publisher is permitted to that role
and nothing else. Role-specific extras (JetStream API, acks, dead letters, request/reply) are
listed here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..bus import event_ids, subjects
from ..bus.catalog import EVENTS, E
from ..schemas import roles
from ..schemas.spec import ID_RE
from ..urls import mask as mask  # re-exported: the CLI and tests use it from here
from . import task_users, tenant_names, tenant_usage
from . import tenants as tn
from .locate import REDIS_ROLE, redis_role_url, with_userinfo  # noqa: F401  (the light half the CLI uses; re-exported)

#: Worker roles the supervisor runs, the CLI's admin, and the roles for people and other systems
#: (``schemas.roles``, the one table of roles and kinds).
WORKER_ROLES = roles.KINDS
ROLES = roles.NATS_USERS
#: ``blocks worker KIND`` / supervisor kinds -> NATS role (an unknown kind runs with the URL it got).
KIND_ROLE = roles.KIND_USER
#: Catalog roles -> NATS users. The admin (CLI) is unrestricted; the simulated fleet (``agent-sim``)
#: publishes what a node agent does, for every node; every other worker kind has a role of its own.
ROLE_USERS = roles.ROLE_USERS

#: What a role publishes that the catalog does not list under it (tell the catalog's owner). Empty:
#: every publish right comes from the catalog.
CATALOG_GAPS: dict[str, tuple[str, ...]] = {}

JS = "$JS.API"
#: every block's task requests (the executors' queue group)
E_TASKS = E.block_task.filter()
#: what tasks carry, the users' data (docs/security.md "Tasks and outputs are not events"): task
#: requests (a tenant's too), outputs, and outputs' dead letters. Only the roles on the task path
#: read them; every other role with a wide subscribe allow has them denied (NATS refuses a
#: subscription to a denied subject and filters it out of the deliveries of every wildcard one that
#: overlaps it: ``aios.>``, ``aios.block.B.>``, ``aios.block.*.*``, checked on nats-server 2.15).
#: The stored ones (outputs and their dead letters) are in ``AIOS_OUTPUTS``, where observers have no
#: consumer; an output dead-lettered before ``output.dlq`` existed stays in ``AIOS`` as
#: ``aios.dlq.sidecar-B-N.aios.output.>`` (docs/security.md), so that subject stays denied too
TASK_DATA_EVENTS = (E.block_task, E.tenant_block_task, E.block_output, E.output_dead_letter)
TASK_DATA = (*(e.filter() for e in TASK_DATA_EVENTS), subjects.dead_letter("*", E.block_output.filter().rsplit(".", 2)[0] + ".>"))


STREAM_INFO = f"{JS}.STREAM.INFO.{subjects.STREAM}"
#: the task outputs' stream (docs/sidecars.md): every worker checks it exists when it starts
OUTPUTS_INFO = f"{JS}.STREAM.INFO.{subjects.STREAM_OUTPUTS}"
#: the creates' stream as sent (only the parser consumes it; everyone else reads ``submitted`` in AIOS)
INTAKE_INFO = f"{JS}.STREAM.INFO.{subjects.STREAM_INTAKE}"
#: Redis ACL users: ``aios`` for workers (only ``aios:*`` keys, nothing @dangerous), ``admin`` for
#: the CLI and setup (everything), ``observer`` (reads only).
REDIS_USERS = {
    "admin": "~* &* +@all",
    "aios": "~aios:* &* +@all -@dangerous",
    "observer": "~aios:* +@read +@connection -@dangerous",
}


def auth_enabled() -> bool:
    """Embedded servers require credentials unless ``AIOS_AUTH=0``."""
    return os.environ.get("AIOS_AUTH", "1").strip().lower() not in ("0", "false", "no", "off")


def tls_enabled() -> bool:
    return os.environ.get("AIOS_NATS_TLS", "0").strip().lower() in ("1", "true", "yes", "on")


def agent_user(nid: str) -> str:
    if not ID_RE.match(nid):
        raise ValueError(f"invalid node id {nid!r}: must match {ID_RE.pattern}")
    return f"agent-{nid}"


def inbox_prefix(user: str) -> str:
    """Each user's private reply subjects: nobody else may subscribe to them."""
    return f"_INBOX.{user}"


# -- permissions ----------------------------------------------------------------------------------
def _catalog_publishers() -> Iterator[tuple[str, str]]:
    """(subject pattern with ``{x}`` placeholders, NATS user role) for every catalog event's
    publisher (a request/reply event's responders answer through ``allow_responses``)."""
    for event in EVENTS:
        for role in event.publishers:
            for user in ROLE_USERS[role]:
                yield event.pattern, user


def _wild(pattern: str, node: str = "*") -> str:
    """``aios.node.{nid}.x`` -> ``aios.node.N.x``; any other ``{x}`` -> ``*``; a trailing
    ``{subject}`` (dead letters) -> ``>``."""
    out = pattern.replace("{nid}", node)
    out = re.sub(r"\{subject\}$", ">", out)
    return re.sub(r"\{[a-z_]+\}", "*", out)


def _consumer_rights(durable: str, create: bool = True, stream: str = subjects.STREAM) -> list[str]:
    st = stream
    rights = [
        f"{JS}.CONSUMER.INFO.{st}.{durable}",
        f"{JS}.CONSUMER.MSG.NEXT.{st}.{durable}",
        f"{JS}.CONSUMER.DELETE.{st}.{durable}",  # to replace a consumer someone else made under its name
        f"$JS.ACK.{st}.{durable}.>",
        subjects.dead_letter(durable, ">"),
    ]
    if create:
        rights += [f"{JS}.CONSUMER.DURABLE.CREATE.{st}.{durable}", f"{JS}.CONSUMER.CREATE.{st}.{durable}",
                   f"{JS}.CONSUMER.CREATE.{st}.{durable}.>"]
    return rights


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    #: publish subjects refused even where ``publish`` allows them (NATS checks deny first)
    deny_publish: tuple[str, ...] = ()
    #: subscriptions refused even where ``subscribe`` allows them; ``"<subject> <queue>"`` refuses
    #: queue subscriptions (``"aios.> *"``: joining any queue group under ``aios.``)
    deny_subscribe: tuple[str, ...] = ()

    def conf(self) -> str:
        q = lambda xs: ", ".join(json.dumps(x) for x in xs)  # noqa: E731
        resp = ", allow_responses: true" if self.allow_responses else ""
        deny = f", deny: [{q(self.deny_publish)}]" if self.deny_publish else ""
        sdeny = f", deny: [{q(self.deny_subscribe)}]" if self.deny_subscribe else ""
        return (f"{{publish: {{allow: [{q(self.publish)}]{deny}}}, subscribe: {{allow: [{q(self.subscribe)}]{sdeny}}}"
                f"{resp}}}")


#: the workers' shared durable consumers; per-node agents' (``agent-<nid>``) and per-cluster
#: controllers' (``controller-<cid>``) are added as they appear (``protect_consumer``)
WORKER_DURABLES = tuple(c.durable for c in (subjects.PARSER, subjects.GATEWAY, subjects.controller(), subjects.LIFECYCLE,
                                             subjects.VCLUSTER, subjects.agent(), subjects.MAPPER))


def _not_theirs(durables: Iterable[str]) -> list[str]:
    """Deny rules that keep a role off these consumers of the ``AIOS`` stream: create or update,
    pull, ack, delete (NATS checks deny first; consumer names are one token with no prefix
    wildcards, so each name is denied on its own)."""
    st = subjects.STREAM
    deny = []
    for d in sorted(set(durables)):
        deny += [f"{JS}.CONSUMER.CREATE.{st}.{d}", f"{JS}.CONSUMER.CREATE.{st}.{d}.>", f"{JS}.CONSUMER.DURABLE.CREATE.{st}.{d}",
                 f"{JS}.CONSUMER.MSG.NEXT.{st}.{d}", f"{JS}.CONSUMER.DELETE.{st}.{d}", f"$JS.ACK.{st}.{d}.>"]
    return deny


#: the durables the controller kind consumes besides its per-cluster ``controller-<cid>``
CONTROLLER_DURABLES = (subjects.controller().durable, subjects.LIFECYCLE.durable, subjects.VCLUSTER.durable)


def _map_writer_rights() -> list[str]:
    """The mapper's durable and the instance-map bucket: create and read its stream (never purge,
    update or delete it), write its keys, watch it through an ordered consumer."""
    kv_stream = f"KV_{subjects.INSTANCE_BUCKET}"
    return [*_consumer_rights(subjects.MAPPER.durable), f"{JS}.INFO",
            f"{JS}.STREAM.CREATE.{kv_stream}", f"{JS}.STREAM.INFO.{kv_stream}", f"{JS}.STREAM.MSG.GET.{kv_stream}",
            f"{JS}.DIRECT.GET.{kv_stream}",
            f"{JS}.DIRECT.GET.{kv_stream}.>", f"{JS}.CONSUMER.*.{kv_stream}", f"{JS}.CONSUMER.*.{kv_stream}.>",
            f"{JS}.CONSUMER.DURABLE.CREATE.{kv_stream}.>", f"$KV.{subjects.INSTANCE_BUCKET}.>", "$JS.FC.>",
            f"$JS.ACK.{kv_stream}.>"]


@dataclass(frozen=True)
class _Role:
    """What a worker role's rights are built from (``permissions``)."""

    role: str
    node: str | None
    scope: str
    protected: tuple[str, ...]
    #: every worker checks the shared consumers at start (``Bus.ensure_topology``): the parser's is on AIOS_INTAKE
    read_topology: tuple[str, ...] = (STREAM_INFO, OUTPUTS_INFO, INTAKE_INFO, f"{JS}.CONSUMER.INFO.{subjects.STREAM}.*",
                                      f"{JS}.CONSUMER.INFO.{subjects.PARSER.stream}.{subjects.PARSER.durable}")
    hints: tuple[str, ...] = (subjects.INVENTORY_ALL, subjects.POLICY_UPDATED_ALL)


@dataclass
class _Rights:
    """A worker role's rights beyond the catalog's publishes and its own inbox."""

    pub: list[str]
    sub: list[str]
    responses: bool = False
    deny: list[str] = field(default_factory=list)
    sub_deny: tuple[str, ...] = ()


def _parser(r: _Role) -> _Rights:
    # its durable is on AIOS_INTAKE (the creates as sent); what it publishes goes to AIOS; and a
    # create by its sequence there (a replayed create's original: workers.parser.generation), or
    # its own dead letter in AIOS once that original is gone (workers.parser.letter_vouches)
    return _Rights([*r.read_topology, *_consumer_rights(subjects.PARSER.durable, stream=subjects.PARSER.stream),
                    f"{JS}.STREAM.MSG.GET.{subjects.STREAM_INTAKE}", f"{JS}.STREAM.MSG.GET.{subjects.STREAM}"], [*r.hints])


def _gateway(r: _Role) -> _Rights:
    # and the dry_run answers (core NATS, a queue group); the tenant desk (``workers.tenants``):
    # tenants' requests (answered through ``allow_responses``), every block event to relay, and the
    # last ``submitted`` of a block (whose create a ``rejected`` answers)
    # (not block tasks: the relay's aios.block.*.> would get every task's input, which it drops; it
    # forwards a tenant's task, and the answer comes to its inbox)
    return _Rights([*r.read_topology, *_consumer_rights(subjects.GATEWAY.durable), f"{JS}.STREAM.MSG.GET.{subjects.STREAM}"],
                   [*r.hints, *subjects.GATEWAY.core_filters, *tn.REQUESTS_ALL, subjects.block_all()], responses=True,
                   sub_deny=(E_TASKS,))


def _controller(r: _Role) -> _Rights:
    # per-cluster durables (controller-<cid>) are named at run time: any consumer name, but
    # never another worker kind's (deleting or pulling the parser's would suppress its events)
    deny = _not_theirs(d for d in {*WORKER_DURABLES, *r.protected} if d not in CONTROLLER_DURABLES
                       and not d.startswith(subjects.controller().durable + "-"))
    # and its queries (core NATS, a queue group): dry_run; replies to aios.node.*.expected requests
    return _Rights([*r.read_topology, *_consumer_rights("*"), f"{JS}.CONSUMER.CREATE.{subjects.STREAM}.*.>"],
                   [*r.hints, subjects.HEARTBEAT_ALL, subjects.EXPECTED_ALL, *subjects.controller().core_filters],
                   responses=True, deny=list(deny))


def _agent(r: _Role) -> _Rights:
    durable = subjects.agent(r.node if r.role == "agent" else None).durable
    # and the side-cars' durables on AIOS_OUTPUTS, deleted when their block goes
    pub = [*r.read_topology, *_consumer_rights(durable), subjects.node_expected(r.scope),
           f"{JS}.CONSUMER.DELETE.{subjects.STREAM_OUTPUTS}.*"]
    return _Rights(pub, [*r.hints] if r.role == "agent-sim" else [])  # the simulated fleet is a Worker like the others


def _map_writer(r: _Role) -> _Rights:
    # the mapper's durable, the instance-map bucket (create, read, write, watch through an
    # ordered consumer); the executor also the tasks of every block as a queue group, replies
    # to requesters (an executor may run a mapper in its process: in-process tests, benchmarks)
    serves_tasks = r.role == "executor"
    return _Rights([*r.read_topology, *_map_writer_rights()], [*r.hints, *[E_TASKS][: int(serves_tasks)]], responses=serves_tasks)


def _map_reader(r: _Role) -> _Rights:
    # the metrics collector publishes no event, the health checker only its verdicts and failed
    # ticks (from the catalog): both read the instance-map bucket (watch through an ordered
    # consumer, direct gets), never write it
    kv_stream = f"KV_{subjects.INSTANCE_BUCKET}"
    return _Rights([*r.read_topology, f"{JS}.INFO", f"{JS}.STREAM.INFO.{kv_stream}", f"{JS}.CONSUMER.CREATE.{kv_stream}",
                    f"{JS}.CONSUMER.CREATE.{kv_stream}.>", f"{JS}.CONSUMER.INFO.{kv_stream}.>",
                    f"{JS}.CONSUMER.DELETE.{kv_stream}.>", f"{JS}.DIRECT.GET.{kv_stream}",
                    f"{JS}.DIRECT.GET.{kv_stream}.>", f"{JS}.STREAM.MSG.GET.{kv_stream}", "$JS.FC.>"], [*r.hints])


def _autoscaler(r: _Role) -> _Rights:
    # publishes its decisions, failed ticks, instance targets and large policy inputs (all from
    # the catalog); reads the stream's topology; no consumer, no bucket: it reads Redis
    return _Rights([*r.read_topology], [*r.hints])


#: worker role -> its rights beyond the catalog's
_WORKER_RIGHTS = {"parser": _parser, "gateway": _gateway, "controller": _controller, "agent": _agent, "agent-sim": _agent,
                  "executor": _map_writer, "mapper": _map_writer, "metrics": _map_reader, "checker": _map_reader,
                  "autoscaler": _autoscaler, "rebalancer": _autoscaler}


def _sidecar(pub: list[str], sub: list[str]) -> Permissions:
    # side-cars (docs/sidecars.md): their durables on AIOS_OUTPUTS (only side-cars have consumers
    # there, so any name), acks; dead letters of outputs (output.dlq, in AIOS_OUTPUTS) and alerts
    # come from the catalog; nothing of the AIOS stream
    so = subjects.STREAM_OUTPUTS
    pub += [f"{JS}.CONSUMER.INFO.{so}.*", f"{JS}.CONSUMER.DURABLE.CREATE.{so}.*", f"{JS}.CONSUMER.CREATE.{so}.*",
            f"{JS}.CONSUMER.CREATE.{so}.*.>", f"{JS}.CONSUMER.MSG.NEXT.{so}.*", f"$JS.ACK.{so}.>"]
    return Permissions(tuple(sorted(set(pub))), tuple(sub))


def permissions(role: str, node: str | None = None, protected: Iterable[str] = ()) -> Permissions | None:
    """The allow lists of a role (``None`` = unrestricted: the admin). ``role="agent"`` with ``node``
    is one real node agent; ``agent-sim`` is the simulated fleet (every node). ``protected``: worker
    consumers beyond ``WORKER_DURABLES``, which the controller kind must not touch and observers may
    only read the info of (they touch only consumers named after them: ``runtime.observers``)."""
    if role == "admin":
        return None
    if role == "agent" and node is None:
        raise ValueError("a node agent's permissions need its node id")
    user = agent_user(node) if role == "agent" and node else role
    catalog_role = "agent" if role in ("agent", "agent-sim") else role
    scope = node if role == "agent" and node else "*"
    pub = sorted({_wild(p, scope) for p, r in _catalog_publishers() if r == catalog_role} | set(CATALOG_GAPS.get(role, ())))
    sub = [f"{inbox_prefix(user)}.>"]
    if role == "upstream":
        return Permissions(tuple(pub), tuple(sub))
    if role == "sidecar":
        return _sidecar(pub, sub)
    if role == "observer":  # the data dir's own; each other observer is a user of its own (runtime.observers)
        from .observers import observer_permissions

        return observer_permissions(protected=protected)
    rights = _WORKER_RIGHTS.get(role)
    if rights is None:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)} or agent")
    got = rights(_Role(role, node, scope, tuple(protected)))
    return Permissions(tuple(sorted({*pub, *got.pub})), tuple(sorted({*sub, *got.sub})), got.responses,
                       deny_publish=tuple(got.deny), deny_subscribe=got.sub_deny)


# -- secrets ----------------------------------------------------------------------------------------
def _token() -> str:
    return secrets.token_urlsafe(24)  # [A-Za-z0-9_-]: safe in URLs, nats.conf and Redis ACL files


@dataclass
class Secrets:
    """Per-role passwords, persisted under ``<data dir>/auth`` (0700) in ``secrets.json`` (0600)."""

    path: Path
    nats: dict[str, str] = field(default_factory=dict)
    redis: dict[str, str] = field(default_factory=dict)
    agents: dict[str, str] = field(default_factory=dict)
    #: the key of the system's wire message ids (``bus.event_ids``), hex
    event_key: str = ""
    #: clusters served by their own controller durable (``controller-<cid>``)
    controllers: list[str] = field(default_factory=list)
    #: tenant name -> its users' passwords and limits (``runtime.tenants``: one NATS account each)
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: block id -> its side-cars' user (``sidecar-<bid>``): password, side-car names, nodes running them
    sidecars: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: observer name -> its user's password (``observer-<name>``: runtime.observers)
    observers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, data_dir: Path, create: bool = True) -> Secrets:
        path = Path(data_dir) / "auth" / "secrets.json"
        s = cls(path)
        if path.exists():
            d = json.loads(path.read_text())
            s.nats, s.redis, s.agents = d.get("nats", {}), d.get("redis", {}), d.get("agents", {})
            s.event_key, s.controllers = d.get("event_key", ""), d.get("controllers", [])
            s.tenants, s.sidecars, s.observers = d.get("tenants", {}), d.get("sidecars", {}), d.get("observers", {})
        elif not create:
            raise FileNotFoundError(path)
        changed = False
        if not s.event_key and create:
            s.event_key, changed = event_ids.new_key(), True
        for role in (*ROLES, tn.MONITOR_USER):  # the system account's user too (tenants.monitor_block)
            if role not in s.nats:
                s.nats[role], changed = _token(), True
        for user in REDIS_USERS:
            if user not in s.redis:
                s.redis[user], changed = _token(), True
        if changed:
            s.save()
        return s

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        write_private(self.path, json.dumps({"nats": self.nats, "redis": self.redis, "agents": self.agents,
                                             "event_key": self.event_key, "controllers": self.controllers,
                                             "tenants": self.tenants, "sidecars": self.sidecars, "observers": self.observers},
                                            indent=1))
        task_users.write(self.path, self.nats, self.tenants)  # the executors' HTTP port's users (hashes), beside them

    def tenant_list(self) -> list[tn.Tenant]:
        return [tn.Tenant.from_dict(name, d) for name, d in sorted(self.tenants.items())]

    def add_agent(self, nid: str) -> bool:
        agent_user(nid)  # validates
        if nid in self.agents:
            return False
        self.agents[nid] = _token()
        self.save()
        return True


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never world-readable in between)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """Serialise changes to the secrets and the server config between processes."""
    lock = Path(data_dir) / "auth" / ".lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- server config ----------------------------------------------------------------------------------
def nats_authorization(s: Secrets) -> str:
    """The accounts of nats.conf (``runtime.tenants``): ``AIOS`` with every role's user and
    permissions and every node agent's, and one account per tenant. It is the config's last part:
    ``_reload_authorization`` rewrites it from ``accounts {`` on."""
    lines = []
    protected = [subjects.agent(nid).durable for nid in s.agents] + [f"controller-{c}" for c in s.controllers]
    for role in ROLES:
        perms = permissions(role, protected=protected)
        p = f", permissions: {perms.conf()}" if perms else ""
        lines.append(f"      {{user: {json.dumps(role)}, password: {json.dumps(s.nats[role])}{p}}}")
    for nid, pw in sorted(s.agents.items()):
        perms = permissions("agent", nid)
        assert perms is not None
        lines.append(f"      {{user: {json.dumps(agent_user(nid))}, password: {json.dumps(pw)}, permissions: {perms.conf()}}}")
    from .sidecar_users import sidecar_permissions, sidecar_user

    for bid, entry in sorted(s.sidecars.items()):
        perms = sidecar_permissions(bid, entry.get("names", []))
        lines.append(f"      {{user: {json.dumps(sidecar_user(bid))}, password: {json.dumps(entry['password'])}, "
                     f"permissions: {perms.conf()}}}")
    from .observers import conf_lines

    return tn.accounts_conf([*lines, *conf_lines(s, protected)], s.tenant_list(), s.nats.get(tn.MONITOR_USER))


def redis_acl(s: Secrets) -> str:
    """An ACL file: the default (passwordless) user is off; one line per user.

    ``default`` is off (no one can log in as it) but keeps every permission: Redis 7.0 replays its
    append-only file as ``default``, and a ``default`` without permissions makes it drop every
    MULTI/EXEC on restart ("ACLs rules changed between the moment the transaction was accumulated
    and the EXEC call"; redis#14541, valkey#3983) - every reservation and status change lost."""
    lines = ["user default off ~* &* +@all"]
    lines += [f"user {user} on >{s.redis[user]} {rules}" for user, rules in REDIS_USERS.items()]
    return "\n".join(lines) + "\n"


def redis_supports_acl(binary: str) -> bool:
    """Redis >= 6 has ACL users; older servers only ``requirepass`` (one password for all)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"v=(\d+)\.", out)
    return m is not None and int(m.group(1)) >= 6


def tls_files(data_dir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost (created once with the openssl CLI)."""
    d = Path(data_dir) / "tls"
    cert, key = d / "cert.pem", d / "key.pem"
    if cert.exists() and key.exists():
        return cert, key
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    try:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-days", "825", "-subj", "/CN=aios-blocks embedded", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )
    except FileNotFoundError:
        raise RuntimeError("AIOS_NATS_TLS=1 needs the openssl command to create a certificate")
    os.chmod(key, 0o600)
    return cert, key


# -- URLs ---------------------------------------------------------------------------------------------
def url_user(url: str) -> str | None:
    """The user name of the first URL of a (comma-separated) server list, if any."""
    first = url.split(",")[0].strip()
    return urlsplit(first).username if "://" in first else None


@dataclass(frozen=True)
class Endpoints:
    """Bare URLs of embedded servers plus where their secrets are (``endpoints.json``)."""

    nats: str
    redis: str
    auth: bool
    data_dir: Path
    nats_ca: str | None = None
    #: False for Redis < 6 (requirepass only): every role then uses the one password, no user name
    redis_acl: bool = True

    def nats_url(self, role: str = "admin", node: str | None = None) -> str:
        if not self.auth:
            return self.nats
        s = Secrets.load(self.data_dir, create=False)
        if role == "agent":
            if node is None or node not in s.agents:
                raise LookupError(f"no credentials for node {node!r}: run ensure_agent first")
            return with_userinfo(self.nats, agent_user(node), s.agents[node])
        return with_userinfo(self.nats, role, s.nats[role])

    def redis_url(self, role: str = "admin") -> str | None:
        """``None`` for roles with no Redis access (node agents, upstream publishers)."""
        return redis_role_url(self.redis, self.data_dir, self.auth, self.redis_acl, role)

    def env(self, kind: str) -> dict[str, str]:
        """Environment of one worker process of ``kind``: its role's URLs (and the TLS CA)."""
        env = {"AIOS_NATS_CA": self.nats_ca} if self.nats_ca else {}
        role = KIND_ROLE.get(kind)
        if role is None or not self.auth:
            return env
        redis = self.redis_url(role)
        key = Secrets.load(self.data_dir, create=False).event_key
        return {**env, "AIOS_NATS_URL": self.nats_url(role), **({"AIOS_REDIS_URL": redis} if redis else {}),
                **({"AIOS_EVENT_KEY": key} if key else {})}

    def agent_env(self, nid: str) -> dict[str, str]:
        """Environment of node ``nid``'s real agent (``blocks agent``): the NATS URL as ``agent-<nid>``
        (the user is added to the running server on first use, ``ensure_agent``) and the TLS CA; no
        Redis, an agent needs none."""
        env = {"AIOS_NATS_CA": self.nats_ca} if self.nats_ca else {}
        if not self.auth:
            return {**env, "AIOS_NATS_URL": self.nats}
        url = ensure_agent(self.data_dir, nid)
        s = Secrets.load(self.data_dir, create=False)
        key = s.event_key
        sidecar = {"AIOS_SIDECAR_NATS_URL": with_userinfo(self.nats, "sidecar", s.nats["sidecar"])} if "sidecar" in s.nats else {}
        sidecar["AIOS_SIDECAR_USERS_DIR"] = str(self.data_dir)  # a user per block (SidecarUsers)
        return {**env, "AIOS_NATS_URL": url, **({"AIOS_EVENT_KEY": event_ids.agent_key(key, nid)} if key else {}), **sidecar}

    def public(self) -> dict[str, object]:
        return {"nats": self.nats, "redis": self.redis, "auth": self.auth, "nats_ca": self.nats_ca, "redis_acl": self.redis_acl}


def read_endpoints(data_dir: Path) -> Endpoints | None:
    ep = Path(data_dir) / "endpoints.json"
    if not ep.exists():
        return None
    d = json.loads(ep.read_text())
    return Endpoints(d["nats"], d["redis"], bool(d.get("auth")), Path(data_dir).resolve(), d.get("nats_ca"), d.get("redis_acl", True))


# -- node agents ------------------------------------------------------------------------------------
def ensure_agent(data_dir: Path, nid: str, timeout: float = 10.0) -> str:
    """NATS URL (with credentials) of node ``nid``'s agent: adds the user ``agent-<nid>`` to the
    running embedded server (config rewrite + reload signal) when it does not exist yet."""
    data_dir = Path(data_dir).resolve()
    ep = read_endpoints(data_dir)
    if ep is None:
        raise RuntimeError(f"no embedded servers running in {data_dir}")
    if not ep.auth:
        return ep.nats
    with locked(data_dir):
        s = Secrets.load(data_dir, create=False)
        if s.add_agent(nid):
            _reload_authorization(data_dir, s)
    url = ep.nats_url("agent", nid)
    wait_nats_user(url, ep.nats_ca, timeout)
    return url


def _reload_authorization(data_dir: Path, s: Secrets, timeout: float = 10.0) -> int:
    """Rewrite nats.conf's accounts and tell the server to reload them (call locked); how many
    reloads it signalled. nats-server 2.15 leaves the imports of an account that a reload creates
    unresolved (its clients' requests find "no responders") until the next reload, so a config that
    adds an account (a tenant, a tenant's user: ``runtime.tenants.account``; the first config after
    tenants' users got an account each) is reloaded twice, the second once the first is done."""
    conf = data_dir / "nats.conf"
    text = conf.read_text()
    # (``authorization {``: a config written before tenants; the server then still runs it)
    start = min(i for i in (text.find("accounts {"), text.find("authorization {")) if i >= 0)
    new = text[:start] + nats_authorization(s)
    added = set(_ACCOUNT.findall(new)) - set(_ACCOUNT.findall(text))
    write_private(conf, new)
    pid = int((data_dir / "nats.pid").read_text().strip())
    if added:
        _signal_and_wait(data_dir, pid, timeout)
    os.kill(pid, signal.SIGHUP)  # = nats-server --signal reload=<pid>
    return 2 if added else 1


RELOADED = "Reloaded server configuration"
#: a tenant user's account in nats.conf (``runtime.tenants._user_account``)
_ACCOUNT = re.compile(r'^  "(tenant-[^"]+)": \{$', re.M)


def _reloads(data_dir: Path) -> int:
    try:
        return (data_dir / "nats.log").read_text(errors="replace").count(RELOADED)
    except OSError:
        return -1


def _signal_and_wait(data_dir: Path, pid: int, timeout: float) -> None:
    before = _reloads(data_dir)
    os.kill(pid, signal.SIGHUP)
    _wait_reloads(data_dir, before + 1, timeout)


def _wait_reloads(data_dir: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while count > 0 and 0 <= _reloads(data_dir) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"nats-server did not reload its config within {timeout}s (see {data_dir / 'nats.log'})")
        time.sleep(0.02)


def _reload_tenant(data_dir: Path, s: Secrets, timeout: float = 10.0) -> None:
    """Load a new tenant's or tenant user's account (call locked): reloaded twice, and awaited
    (``_reload_authorization``)."""
    reload_and_wait(data_dir, s, timeout)


def reload_and_wait(data_dir: Path, s: Secrets, timeout: float) -> None:
    """``_reload_authorization``, then wait for the server's log to say it reloaded (a login test
    would not tell that a user's *new* permissions are in force). Call locked."""
    before = _reloads(data_dir)
    n = _reload_authorization(data_dir, s, timeout)
    if before >= 0:
        _wait_reloads(data_dir, before + n, timeout)


def protect_controller(data_dir: Path, cid: str) -> bool:
    """Before a per-cluster controller creates ``controller-<cid>``: add it to the workers' durables
    on the running embedded server (other worker kinds may not touch it, observers only read its
    info). False when there is nothing to do (no embedded server, no auth)."""
    ep = read_endpoints(Path(data_dir).resolve())
    if ep is None or not ep.auth:
        return False
    if not ID_RE.match(cid):
        raise ValueError(f"invalid cluster id {cid!r}")
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        if cid in s.controllers:
            return False
        s.controllers.append(cid)
        s.save()
        _reload_authorization(ep.data_dir, s)
    time.sleep(0.2)  # the reload is asynchronous
    return True


def nats_login(url: str, ca: str | None = None) -> bool:
    """One synchronous CONNECT/PING with the URL's credentials: True when the server accepts them."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=2) as raw:
        f = raw.makefile("rb")
        info = json.loads(f.readline().split(b" ", 1)[1])
        sock: socket.socket = raw
        if info.get("tls_required"):
            ctx = ssl.create_default_context(cafile=ca)
            sock = ctx.wrap_socket(raw, server_hostname=parts.hostname)
            f = sock.makefile("rb")
        opts = {"user": parts.username, "pass": parts.password, "verbose": False, "pedantic": False}
        sock.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
        return f.readline().startswith(b"PONG")


def wait_nats_user(url: str, ca: str | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not nats_login(url, ca):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nats-server did not accept the new user {url_user(url)!r} within {timeout}s")
        time.sleep(0.05)


# -- tenants (runtime.tenants: one NATS account each) ------------------------------------------------
def secured_endpoints(data_dir: Path, what: str) -> Endpoints:
    """The running embedded servers' endpoints, which must require credentials for ``what``
    (``"tenants"``, ``"observers"``: users are added to them); RuntimeError saying why not."""
    ep = read_endpoints(Path(data_dir).resolve())
    if ep is None:
        raise RuntimeError(f"no embedded servers running in {data_dir} (start `blocks up`)")
    if not ep.auth:
        raise RuntimeError(f"{what} need servers that require credentials: these run with AIOS_AUTH=0")
    return ep


def credentials_path(data_dir: Path, tenant: str, user: str) -> Path:
    return Path(data_dir).resolve() / "tenants" / tn.check_name(tenant) / f"{tn.check_name(user, 'user name')}.json"


def _write_credentials(ep: Endpoints, tenant: str, user: str, password: str) -> Path:
    path = credentials_path(ep.data_dir, tenant, user)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent.parent, 0o700)
    write_private(path, json.dumps(tn.credentials(tenant, user, password, ep.nats, ep.nats_ca), indent=1) + "\n")
    return path


def tenant_user_url(data_dir: Path, tenant: str, user: str = tn.FIRST_USER) -> str:
    """The NATS URL (with credentials) of a tenant's user."""
    ep = secured_endpoints(data_dir, "tenants")
    s = Secrets.load(ep.data_dir, create=False)
    pw = (s.tenants.get(tenant) or {}).get("users", {}).get(user)
    if pw is None:
        raise LookupError(f"no user {user!r} in tenant {tenant!r}")
    return with_userinfo(ep.nats, tn.user_name(tenant, user), pw)


def add_tenant(data_dir: Path, tenant: str, limits: tn.Limits | None = None, timeout: float = 10.0) -> tuple[bool, Path]:
    """Make ``tenant``'s account, first user ``main``, on the running embedded server (config rewrite
    + reload): (whether new, its credentials file). An existing one keeps its users; ``limits`` replace its."""
    ep = secured_endpoints(data_dir, "tenants")
    tn.check_name(tenant)
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        new = tenant not in s.tenants
        tenant_names.refuse_case_twin("tenant", tenant, s.tenants)
        t = tn.Tenant.from_dict(tenant, s.tenants.get(tenant, {}))
        old = tn.Tenant.from_dict(tenant, s.tenants.get(tenant, {}))
        t.users.setdefault(tn.FIRST_USER, _token())
        if limits is not None:
            t.limits = limits
        # the new limits split across its users (ValueError: which to raise); a first user that an
        # older version let `tenant user remove` take comes back (its file alone would not log in)
        if new or limits is not None or tn.FIRST_USER not in old.users:
            tenant_usage.check(t, old, ep.nats, ep.nats_ca, s.nats.get(tn.MONITOR_USER))
            s.tenants[tenant] = t.to_dict()
            s.save()
            # awaited: its (re-split) limits are in force once this returns
            (_reload_tenant if new else reload_and_wait)(ep.data_dir, s, 10.0)
        path = _write_credentials(ep, tenant, tn.FIRST_USER, t.users[tn.FIRST_USER])
    wait_nats_user(tenant_user_url(ep.data_dir, tenant), ep.nats_ca, timeout)
    return new, path


def remove_tenant(data_dir: Path, tenant: str) -> bool:
    """Remove the tenant's account (its connections are closed by the reload) and credentials."""
    ep = secured_endpoints(data_dir, "tenants")
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        if s.tenants.pop(tn.check_name(tenant), None) is None:
            return False
        s.save()
        _reload_authorization(ep.data_dir, s)
    folder = Path(ep.data_dir) / "tenants" / tenant
    for f in folder.glob("*.json"):
        f.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()
    return True


def add_tenant_user(data_dir: Path, tenant: str, user: str, timeout: float = 10.0) -> tuple[bool, Path]:
    """A user of its own for one of the tenant's clients; (whether it is new, its credentials file)."""
    ep = secured_endpoints(data_dir, "tenants")
    tn.user_name(tenant, user)  # validates both
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        if tenant not in s.tenants:
            raise LookupError(f"no tenant {tenant!r} (blocks tenant add {tenant})")
        t = tn.Tenant.from_dict(tenant, s.tenants[tenant])
        new = user not in t.users
        tenant_names.refuse_case_twin(f"user of tenant {tenant!r}", user, t.users)
        if new:  # its limits split anew, one more share (ValueError: which to raise, or what holds too much)
            t.users[user] = _token()
            s.tenants[tenant] = tenant_usage.check(t, tn.Tenant.from_dict(tenant, s.tenants[tenant]), ep.nats, ep.nats_ca,
                                                   s.nats.get(tn.MONITOR_USER)).to_dict()
            s.save()
            _reload_tenant(ep.data_dir, s)  # a new account: the user's own (runtime.tenants.account)
        path = _write_credentials(ep, tenant, user, t.users[user])
    wait_nats_user(tenant_user_url(ep.data_dir, tenant, user), ep.nats_ca, timeout)
    return new, path


def remove_tenant_user(data_dir: Path, tenant: str, user: str) -> bool:
    ep = secured_endpoints(data_dir, "tenants")
    with locked(ep.data_dir):
        s = Secrets.load(ep.data_dir, create=False)
        t = s.tenants.get(tenant)
        if t is None or user not in (t.get("users") or {}):
            return False
        if user == tn.FIRST_USER:
            raise ValueError(f"{tn.user_name(tenant, user)!r} is the first user of tenant {tenant!r}: its account "
                             f"{tn.account(tenant)!r} (the streams made there) and the file `blocks submit --tenant {tenant}` "
                             f"uses go with it, so it stays while the tenant does: remove the tenant (`blocks tenant remove "
                             f"{tenant}`), or only users added with `blocks tenant user add`")
        del t["users"][user]
        s.save()
        reload_and_wait(ep.data_dir, s, 10.0)  # its share back to the others' accounts, in force on return
    with contextlib.suppress(FileNotFoundError):
        credentials_path(ep.data_dir, tenant, user).unlink()
    return True


def tenants(data_dir: Path) -> list[dict[str, Any]]:
    """Every tenant as ``runtime.tenants.describe`` shows it: users, accounts, limits, shares."""
    return [tn.describe(t) for t in Secrets.load(Path(data_dir).resolve(), create=False).tenant_list()]
