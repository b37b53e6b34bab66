"""The Redis exchanges of the parser's turn (docs/trace.md "The parser's reads in one exchange"), on
real NATS JetStream and Redis: the component, the priority classes, the registry policies the
block names itself (read ahead of ``pinned_versions``) and the tenant check's first read go to
Redis in one exchange; the component's registry policies the block does not override, together in
one more; the outcome is the same (the versions pinned, a tenant over its limit or a label naming
an account refused with the same reason)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import outbox
from aios_blocks.bus.router import Inbound
from aios_blocks.bus.runner import Delivery
from aios_blocks.cli.client import Client
from aios_blocks.settings import Settings
from aios_blocks.state.tenants import LIMITS, TenantStore
from aios_blocks.workers import parser
from aios_blocks.workers.base import Worker

from .conftest import COMPONENT, worker_rig
from .loop_tasks import tasks_made
from .test_create_exchanges import Exchanges, _noted

pytestmark = pytest.mark.integration

URI = "aios://test/registry"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[tuple[Worker, Client]]:
    async with worker_rig(tmp_path, "parser", Settings()) as (w, client):
        await client.add_component({**COMPONENT, "componentURI": URI, "policies": [
            {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank"},
            {"name": "resourceAllocator", "policyRuleURI": "registry:packer"},
            {"name": "autoscaler", "policyRuleURI": "registry:scaler"}]})
        await w.store.policy_store("packer", 3, "def x(): pass", "python")
        await w.store.policy_store("scaler", 5, "def x(): pass", "python")
        await w.store.policy_store("mine", 2, "def x(): pass", "python")
        await w.store.create_block("warm", 1, "d", {"status": "rejected"})  # the worker's scripts loaded
        yield w, client


async def _create(w: Worker, bid: str, spec: dict[str, Any], tenant: str = "", seq: int = 5) -> tuple[list[str], Exchanges]:
    """``spec`` created (on the tenant's subject when given): the events stored, the exchanges."""
    raw = msgspec.json.encode(spec)
    event = E.tenant_block_create if tenant else E.block_create
    subject = event.subject(tenant=tenant, bid=bid) if tenant else event.subject(bid=bid)
    tokens = {"bid": bid, "tenant": tenant} if tenant else {"bid": bid}
    seen = _noted(w)
    with outbox(defer=bool(w.bus.atomic_streams)) as box:
        await parser.on_create(w, Inbound(event, raw, tokens, Delivery(subject, raw, {}, 1, seq)))
    assert await w.bus.commit([box.deferred], 10.0) == [""]
    return [d.subject.rsplit(".", 1)[1] for d in box.deferred], list(seen)


def _reads(ex: list[tuple[str, str]]) -> set[tuple[str, str]]:
    return set(ex)


async def test_the_block_s_own_registry_policies_are_read_with_its_component(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    # the block's own registry policy overrides the component's autoscaler; the component's
    # resourceAllocator is read after the component, alone
    spec = {"blockComponentURI": URI, "minInstances": 1, "maxInstances": 1,
            "policyRulesSpec": [{"name": "autoscaler", "policyRuleURI": "registry:mine"}]}
    events, seen = await _create(w, "rp-1", spec)
    assert events == ["submitted", "parsed"]
    assert len(seen) == 3, seen
    assert _reads(seen[0]) == {("GET", f"aios:component:{URI}"), ("HGETALL", "aios:priorityclasses"),
                               ("HGETALL", "aios:policy:mine")}, seen
    assert seen[1] == [("HGETALL", "aios:policy:packer")], seen
    assert seen[2][0] == ("EVALSHA", "aios:block:rp-1"), seen
    block = await w.store.get_block("rp-1")
    assert block is not None and block["status"] == "parsed"
    policies = block["ir"]["policies"]
    assert (policies["resourceAllocator"]["version"], policies["autoscaler"]["version"]) == (3, 2)
    assert policies["autoscaler"]["policyRuleURI"] == "registry:mine"


async def test_the_component_s_registry_policies_are_read_together(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    events, seen = await _create(w, "rp-2", {"blockComponentURI": URI, "minInstances": 1, "maxInstances": 1})
    assert events == ["submitted", "parsed"]
    assert len(seen) == 3 and _reads(seen[1]) == {("HGETALL", "aios:policy:packer"), ("HGETALL", "aios:policy:scaler")}, seen
    block = await w.store.get_block("rp-2")
    assert block is not None
    assert (block["ir"]["policies"]["resourceAllocator"]["version"], block["ir"]["policies"]["autoscaler"]["version"]) == (3, 5)


async def test_a_tenant_s_limit_is_read_with_the_component(rig: tuple[Worker, Client]) -> None:
    w, _client = rig
    spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}
    await _client.add_component(COMPONENT)
    tenants = TenantStore(w.store.r)
    # no limit set: one read before the create (with the component), the create, the pending set
    events, seen = await _create(w, "t-1", spec, tenant="acme")
    assert events == ["submitted", "parsed"]
    assert ("HGET", LIMITS) in seen[0] and ("GET", "aios:component:aios://test/model") in seen[0], seen
    assert len(seen) == 3, seen
    block = await w.store.get_block("t-1")
    assert block is not None and block["ir"]["labels"]["tenant"] == "acme"
    # at its limit: refused with the reason, the limit read with the component
    await tenants.set_limit("acme", 1)
    events, seen = await _create(w, "t-2", spec, tenant="acme", seq=6)
    assert events == ["submitted", "rejected"]
    assert ("HGET", LIMITS) in seen[0] and ("GET", "aios:component:aios://test/model") in seen[0], seen
    block = await w.store.get_block("t-2")
    assert block is not None and block["status"] == "rejected" and "creates pending" in block["reason"], block


async def test_a_label_naming_an_account_is_checked_with_the_component(rig: tuple[Worker, Client]) -> None:
    w, client = rig
    await client.add_component(COMPONENT)
    await TenantStore(w.store.r).set_limit("acme", 5)
    spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1, "labels": {"tenant": "acme"}}
    events, seen = await _create(w, "l-1", spec)
    assert events == ["submitted", "rejected"]
    assert ("HEXISTS", LIMITS) in seen[0] and ("GET", "aios:component:aios://test/model") in seen[0], seen
    block = await w.store.get_block("l-1")
    assert block is not None and block["status"] == "rejected" and "names a tenant with an account" in block["reason"]


async def test_the_turn_gathers_no_task_of_its_own(rig: tuple[Worker, Client]) -> None:
    """The reads before the parse (the component, the priority classes, the block's own registry
    policies) go to Redis as one pipeline, not as calls gathered in a task each: a create with no
    tenant check starts no task but the auto-pipeline's flushes, one per exchange."""
    w, client = rig
    await client.add_component(COMPONENT)  # no registry policy of its own: no second read
    spec = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
            "policyRulesSpec": [{"name": "autoscaler", "policyRuleURI": "registry:mine"}]}
    # once per process, each a task of its own: the bus's event key, the ack subscription
    assert (await _create(w, "nt-0", spec))[0] == ["submitted", "parsed"]
    with tasks_made() as made:
        events, seen = await _create(w, "nt-1", spec, seq=6)
    assert events == ["submitted", "parsed"]
    assert len(seen) == 2, seen
    assert _reads(seen[0]) == {("GET", "aios:component:aios://test/model"), ("HGETALL", "aios:priorityclasses"),
                               ("HGETALL", "aios:policy:mine")}, seen
    assert made == ["AutoPipelineRedis._flush"] * 2, made
    block = await w.store.get_block("nt-1")
    assert block is not None and block["ir"]["policies"]["autoscaler"]["version"] == 2



async def test_an_unregistered_policy_is_refused_from_the_same_reads(rig: tuple[Worker, Client]) -> None:
    """The registry check reads nothing more than the parse did: the block's own registry
    policies and whether each version it pins is stored go with the component, the component's
    together after it; the create is refused with every unregistered one."""
    w, _client = rig
    spec = {"blockComponentURI": URI, "minInstances": 1, "maxInstances": 1, "policyRulesSpec": [
        {"name": "autoscaler", "policyRuleURI": "registry:mine@7"},
        {"name": "loadBalancer", "policyRuleURI": "registry:nope"}]}
    await w.store.policy_store("mine", 1, "def x(): pass", "python")  # versions 1 and 2 stored, no 7
    events, seen = await _create(w, "rp-3", spec)
    assert events == ["submitted", "rejected"]
    assert len(seen) == 3, seen
    assert _reads(seen[0]) == {("GET", f"aios:component:{URI}"), ("HGETALL", "aios:priorityclasses"),
                               ("HGETALL", "aios:policy:mine"), ("HGETALL", "aios:policy:nope"),
                               ("EXISTS", "aios:policy:mine:v7")}, seen
    assert seen[1] == [("HGETALL", "aios:policy:packer")], seen
    block = await w.store.get_block("rp-3")
    assert block is not None and block["status"] == "rejected"
    assert "policy 'mine' has no version 7 (its latest is version 2)" in block["reason"], block
    assert "no policy 'nope' is registered" in block["reason"], block
    # a stored version: placed with it, from the same reads
    events, seen = await _create(w, "rp-4", {**spec, "policyRulesSpec": [
        {"name": "autoscaler", "policyRuleURI": "registry:mine@1"}]}, seq=6)
    assert events == ["submitted", "parsed"] and len(seen) == 3, seen
    assert ("EXISTS", "aios:policy:mine:v1") in seen[0], seen
