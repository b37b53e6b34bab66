"""Tenants as NATS accounts (docs/security.md "Tenants"): pure config, no I/O.

The embedded nats-server keeps the system's users (one per role, one per node agent) in the
account ``AIOS``, and each tenant in an account of its own, ``tenant-<name>``. A tenant's account
sees nothing of ``AIOS`` but what ``AIOS`` exports to it alone, under the tenant's own subjects:

* its requests, as **service** imports: what its clients send on ``aios.block.B.task``,
  ``aios.block.B.scale``, ``aios.block.B.delete`` and ``aios.block.B.history`` (core requests)
  reaches ``AIOS`` as ``aios.tenant.<name>.block.B.<request>``, and ``aios.block.B.create`` (a
  JetStream publish) as ``aios.tenant.<name>.intake.B.create``, where the gateway's desk stores it
  in ``AIOS_INTAKE`` (as ``aios.tenant.<name>.block.B.create``, its ``Nats-Msg-Id`` scoped to the
  tenant: ``scoped_msg_id``) and answers the stream's PubAck: the server puts the tenant's name in
  the subject, so no client can speak for another tenant, nor suppress another's create;
* its blocks' events, as a **stream** import: the gateway relays each stored ``aios.block.B.…``
  event of a block the tenant owns to ``aios.tenant.<name>.event.B.…``, which the tenant's
  clients receive as ``aios.block.B.…``.

**An account per user.** Each of a tenant's users has an account of its own (``account``: the
first user's is ``tenant-<name>``, each further user's ``tenant-<name>.<user>``), with the same
imports: what one user publishes (its tasks, creates, scales, deletes, history requests) and the
answers to it (on its account's ``_INBOX.``) never enter another user's account, so no other user
can subscribe to them, capture them with a JetStream stream of its own or answer them first. The
relayed events reach every user's account alike (a tenant's blocks are all its users'). A default
client configuration works (no inbox prefix). Users are config-file users with passwords
(``<name>.<user>``), added with a config reload as node agents are (``auth``).

**Limits are the tenant's.** nats-server limits an account (connections, JetStream bytes, streams,
consumers), not a group of them, so the tenant's figures are split across its users' accounts
(``shares``: equal, the remainder one each from ``main`` on) and split anew whenever a user comes
or goes (the config is rewritten then anyway): all its users together never hold more than the
tenant's figure. A split that cannot give every account at least one of each is refused (``check``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..schemas.spec import ID_RE

#: the account of the system's own users (roles, node agents): the stream lives there
SYSTEM_ACCOUNT = "AIOS"
ROOT = "aios"
#: what a tenant's clients may ask the system, each a core request (``create`` a JetStream publish;
#: ``history`` a page of its block's stored events, read by the desk from ``AIOS``)
REQUESTS = ("create", "task", "scale", "delete", "history")
#: a tenant's first user (``blocks tenant add``); more with ``blocks tenant user add``
FIRST_USER = "main"
#: nats-server's own system account (its default name: no ``system_account`` setting), given one
#: user while tenants exist, the admin side's reader of a tenant account's JetStream use
#: (``runtime.tenant_usage``) without a connection of that account's, whose share may be all in use
MONITOR_ACCOUNT = "$SYS"
#: that user (its password in the secrets file, ``auth.Secrets.nats``, as the roles' are)
MONITOR_USER = "aios-monitor"
#: all it may ask (the server's JetStream use, by account: ``$SYS.REQ.SERVER.PING.JSZ``; not
#: ``$SYS.REQ.ACCOUNT.<account>.JSZ``, whose one token cannot name a further user's account,
#: ``tenant-T.U``), and the one inbox its answers come to: not the server's other requests
#: (connections, reload, kick)
MONITOR_ASKS = "$SYS.REQ.SERVER.PING.JSZ"
MONITOR_INBOX = "_INBOX.aios-usage"


def check_name(name: str, what: str = "tenant name") -> str:
    if not isinstance(name, str) or not ID_RE.match(name):
        raise ValueError(f"invalid {what} {name!r}: must match {ID_RE.pattern}")
    return name


def account(tenant: str, user: str = FIRST_USER) -> str:
    """The NATS account of one of a tenant's users: ``tenant-<tenant>`` for its first user (the
    tenant's account before users had one each: its streams stay there), ``tenant-<tenant>.<user>``
    for any other (no tenant name holds a dot)."""
    base = f"tenant-{check_name(tenant)}"
    return base if check_name(user, "user name") == FIRST_USER else f"{base}.{user}"


def user_name(tenant: str, user: str) -> str:
    """A tenant's NATS user: ``<tenant>.<user>``. The dot keeps it apart from every system user
    (role names and ``agent-<nid>`` hold none) and from every other tenant's users."""
    return f"{check_name(tenant)}.{check_name(user, 'user name')}"


def request_subject(tenant: str, request: str, bid: str = "*") -> str:
    """Where a tenant's request arrives in ``AIOS``: ``aios.tenant.<t>.block.<bid>.<request>``."""
    return f"{ROOT}.tenant.{tenant}.block.{bid}.{request}"


def event_subject(tenant: str, subject: str) -> str:
    """The relayed copy of a block event ``aios.block.B.…`` for the tenant that owns B."""
    return f"{ROOT}.tenant.{tenant}.event.{subject.removeprefix(ROOT + '.block.')}"


def import_subject(tenant: str, request: str, bid: str = "*") -> str:
    """Where the server hands a tenant's request to ``AIOS`` (the service import's subject): a
    create to the gateway's desk, ``aios.tenant.<t>.intake.<bid>.create``, which stores it in
    ``AIOS_INTAKE`` as ``request_subject(t, "create")`` with its ``Nats-Msg-Id`` scoped to the tenant
    (``scoped_msg_id``); any other request at ``request_subject``, where the desk answers it."""
    if request == "create":
        return f"{ROOT}.tenant.{tenant}.intake.{bid}.create"
    return request_subject(tenant, request, bid)


#: the prefix of a tenant's create's ``Nats-Msg-Id`` in ``AIOS_INTAKE``
MSG_ID_PREFIX = "tenant:"


def scoped_msg_id(tenant: str, msg_id: str) -> str:
    """A tenant's create's ``Nats-Msg-Id`` as stored: ``tenant:<t>:<the client's>``. JetStream
    deduplicates a stream's messages by that header whoever sent them; scoped, a tenant's retries
    are still dropped as repeats, and no other publisher (another tenant, ``upstream``) can send
    an id that drops it, nor learn from a ``duplicate`` PubAck that it was used."""
    return f"{MSG_ID_PREFIX}{tenant}:{msg_id}"


#: a tenant's requests as the gateway's tenant desk takes them (``workers.tenants``): the create's
#: first (``import_subject``)
REQUESTS_ALL = tuple(import_subject("*", r) for r in REQUESTS)


def _replayable() -> tuple[str, ...]:
    from ..schemas.catalog import EVENTS, STREAM

    requests = {f"{ROOT}.block.*.{r}" for r in REQUESTS}
    return tuple(sorted({e.filter() for e in EVENTS if e.stored and e.stream == STREAM
                         and e.pattern.startswith(f"{ROOT}.block.{{bid}}.")} - requests))


#: the subjects of a tenant's blocks' events that a stream in its own account may keep, to replay
#: them: every relayed event but those on a request's subject (``aios.block.*.delete``). A stream on
#: ``aios.block.>`` would also take its clients' requests: it would store them and answer them
#: with its own PubAck (a create's, a task's) before the system does.
REPLAYABLE = _replayable()


@dataclass
class Limits:
    """A tenant's limits, for the tenant as a whole: the server enforces the account ones
    (``SPLIT``) on each of its users' accounts, so each account gets a share (``shares``) and the
    shares add up to the tenant's figure; the parser ``pending_creates``, per tenant."""

    #: client connections at once (its accounts' ``max_connections``, split)
    connections: int = 64
    #: its creates not yet placed, failed, rejected or deleted: the parser refuses more
    #: (``state.tenants``; ``blocks tenant add`` writes it to Redis)
    pending_creates: int = 100
    #: bytes the tenant's own JetStream streams may hold (file storage), e.g. to replay its events
    stream_bytes: int = 64 * 1024 * 1024
    memory_bytes: int = 8 * 1024 * 1024
    #: at least 1 per user account (nats-server reads 0 as no limit): the default admits 16 users
    streams: int = 16
    consumers: int = 64

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Limits:
        known = {k: int(v) for k, v in (d or {}).items() if k in cls.__dataclass_fields__}
        return cls(**known)


#: the limits the server enforces per account, split across a tenant's users' accounts, and the
#: ``blocks tenant add`` flag that sets each
SPLIT = {"connections": "--max-connections", "stream_bytes": "--max-stream-bytes", "memory_bytes": "--max-memory-bytes",
         "streams": "--max-streams", "consumers": "--max-consumers"}
#: those of them a share may not be 0 of: nats-server reads ``max_streams``/``max_consumers`` 0 as
#: no limit, and an account with ``max_connections`` 0 lets its user in never (a byte limit of 0
#: is "none": a tenant's 0 gives every account 0)
AT_LEAST_ONE = ("connections", "streams", "consumers")


def ordered(users: Mapping[str, str] | list[str]) -> list[str]:
    """A tenant's users in the order shares are dealt: ``main`` first, then by name."""
    return sorted(users, key=lambda u: (u != FIRST_USER, u))


def _split(total: int, n: int) -> list[int]:
    """``total`` over ``n`` accounts: equal shares, the remainder one each from the first."""
    if n <= 0:
        return []
    base, rest = divmod(max(total, 0), n)
    return [base + (i < rest) for i in range(n)]


def shares(t: Tenant) -> dict[str, dict[str, int]]:
    """Each user's account's share of the tenant's limits (``SPLIT``): they add up to the tenant's
    figure. A split ``unfit`` refuses (a config written before gets 1 where it would be 0: more
    than the tenant's figure until its operator raises it or removes a user; ``describe`` says so)."""
    users = ordered(t.users)
    out: dict[str, dict[str, int]] = {u: {} for u in users}
    for name in SPLIT:
        for u, n in zip(users, _split(getattr(t.limits, name), len(users)), strict=True):
            out[u][name] = max(n, 1) if name in AT_LEAST_ONE else n
    return out


def unfit(t: Tenant) -> str | None:
    """Why the tenant's limits cannot give each of its users' accounts a share, or ``None``."""
    n = len(t.users)
    for name, flag in SPLIT.items():
        total = getattr(t.limits, name)
        if n and total < n and (name in AT_LEAST_ONE or total > 0):
            what = name.replace("_", " ").removesuffix("s")
            return (f"tenant {t.name!r}: {flag} {total} cannot give each of its {n} users' accounts at least one "
                    f"{what} (the limit is the tenant's, split across its users): raise it "
                    f"(`blocks tenant add {t.name} {flag} {n}` or more) or remove a user")
    return None


def check(t: Tenant) -> Tenant:
    """``t``, or ValueError when its limits cannot be split across its users (``unfit``)."""
    if (why := unfit(t)) is not None:
        raise ValueError(why)
    return t


def describe(t: Tenant) -> dict[str, Any]:
    """A tenant as ``blocks tenant list|get --json`` shows it (no password): its users and their
    accounts, its limits (the tenant's totals) and each account's ``shares``; ``fits`` false: a
    split that gives some account 1 of a limit smaller than its users (``shares``)."""
    split = shares(t)
    return {"tenant": t.name, "account": account(t.name), "users": [user_name(t.name, u) for u in sorted(t.users)],
            "accounts": {user_name(t.name, u): account(t.name, u) for u in sorted(t.users)},
            "limits": asdict(t.limits), "fits": unfit(t) is None,
            "shares": {account(t.name, u): split[u] for u in ordered(t.users)}}


@dataclass
class Tenant:
    name: str
    #: user name (without the tenant prefix) -> password
    users: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)

    def to_dict(self) -> dict[str, Any]:
        return {"users": dict(self.users), "limits": asdict(self.limits)}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> Tenant:
        return cls(name, dict(d.get("users") or {}), Limits.from_dict(d.get("limits")))


def _q(xs: list[str] | tuple[str, ...]) -> str:
    return ", ".join(json.dumps(x) for x in xs)


def user_permissions() -> str:
    """A tenant user's rights inside its own account (it is that account's only user): the five
    requests, its account's own JetStream (bounded by the account's limits), and reading anything
    there (its inbox, its own requests, the tenant's relayed events). It may not publish block
    events, even in its own account (its own clients would read them as the system's)."""
    pub = [f"{ROOT}.block.*.{r}" for r in REQUESTS] + ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>"]
    return f"{{publish: {{allow: [{_q(pub)}]}}, subscribe: {{allow: [\">\"]}}}}"


def exports(tenants: list[Tenant]) -> list[str]:
    """``AIOS``'s exports: each tenant's request subjects and event stream. Public (no ``accounts:
    [...]`` list): only the accounts of this generated config can import anything, and each imports
    its own tenant's subjects only (``account_block``); tenants cannot change the config."""
    out = []
    for t in tenants:
        for r in REQUESTS:
            out.append(f"{{service: {json.dumps(import_subject(t.name, r))}}}")
        out.append(f"{{stream: {json.dumps(event_subject(t.name, f'{ROOT}.block.>'))}}}")
    return out


def account_block(t: Tenant) -> str:
    """The tenant's accounts, one per user (``account``): each with its share of the tenant's
    limits (``shares``), that one user and the tenant's imports."""
    split = shares(t)
    return "".join(_user_account(t, u, pw, split[u]) for u, pw in sorted(t.users.items()))


def _user_account(t: Tenant, user: str, password: str, share: Mapping[str, int] | None = None) -> str:
    lim = share if share is not None else shares(t).get(user) or asdict(t.limits)
    sys_ = json.dumps(SYSTEM_ACCOUNT)
    imports = [f"{{service: {{account: {sys_}, subject: {json.dumps(import_subject(t.name, r))}}}, "
               f"to: {json.dumps(f'{ROOT}.block.*.{r}')}}}" for r in REQUESTS]
    imports.append(f"{{stream: {{account: {sys_}, subject: {json.dumps(event_subject(t.name, f'{ROOT}.block.>'))}}}, "
                   f"to: {json.dumps(f'{ROOT}.block.>')}}}")
    return (f"  {json.dumps(account(t.name, user))}: {{\n"
            f"    limits: {{max_connections: {lim['connections']}}}\n"
            f"    jetstream: {{max_file: {lim['stream_bytes']}, max_mem: {lim['memory_bytes']}, "
            f"max_streams: {lim['streams']}, max_consumers: {lim['consumers']}}}\n"
            f"    users: [\n      {{user: {json.dumps(user_name(t.name, user))}, password: {json.dumps(password)}, "
            f"permissions: {user_permissions()}}}\n    ]\n"
            f"    imports: [\n      " + ",\n      ".join(imports) + "\n    ]\n  }\n")


def accounts_conf(system_users: list[str], tenants: list[Tenant], monitor: str | None = None) -> str:
    """The ``accounts`` block of nats.conf: ``AIOS`` with the system's users (``system_users``:
    one ``{user: …}`` entry each) and its exports, then one account per tenant, then, while there
    are tenants and with ``monitor`` (its password), the system account's one user (``monitor_block``)."""
    ex = exports(tenants)
    ex_text = ("    exports: [\n      " + ",\n      ".join(ex) + "\n    ]\n") if ex else ""
    text = (f"accounts {{\n  {SYSTEM_ACCOUNT}: {{\n    jetstream: enabled\n"
            f"    users: [\n" + "\n".join(system_users) + "\n    ]\n" + ex_text + "  }\n")
    for t in sorted(tenants, key=lambda t: t.name):
        text += account_block(t)
    if monitor and tenants:
        text += monitor_block(monitor)
    return text + "}\n"


def monitor_block(password: str) -> str:
    """nats-server's system account (``MONITOR_ACCOUNT``) with ``MONITOR_USER``, who may ask an
    account's JetStream use and read the answer, nothing more."""
    perms = f"{{publish: {{allow: [{_q([MONITOR_ASKS])}]}}, subscribe: {{allow: [{_q([MONITOR_INBOX])}]}}}}"
    return (f"  {json.dumps(MONITOR_ACCOUNT)}: {{\n    users: [\n      {{user: {json.dumps(MONITOR_USER)}, "
            f"password: {json.dumps(password)}, permissions: {perms}}}\n    ]\n  }}\n")


def credentials(tenant: str, user: str, password: str, url: str, ca: str | None) -> dict[str, Any]:
    """What a tenant's client needs, as the credentials file holds it (JSON, 0600)."""
    return {"tenant": tenant, "account": account(tenant, user), "url": url, "user": user_name(tenant, user), "password": password,
            **({"ca": ca} if ca else {})}
