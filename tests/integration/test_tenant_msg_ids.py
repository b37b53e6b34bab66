"""A tenant's create's ``Nats-Msg-Id`` is the tenant's own (docs/security.md "Tenants"): JetStream
deduplicates a stream by that header whoever sent it, so when tenants' creates were stored as sent,
one tenant's create with a ``Nats-Msg-Id`` another tenant (or ``upstream``) had used within the
duplicate window was dropped (its PubAck ``duplicate: true`` with the other's ``seq``), and a tenant
that guessed another's ids suppressed its creates. The gateway's desk now stores a tenant's create
with its id scoped (``tenant:<t>:<id>``): each publisher's retries are still dropped, nobody else's."""

from __future__ import annotations

import nats
import pytest

from aios_blocks.bus import subjects

from .conftest import System
from .test_tenants import HEADERS, Seen, create, login

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True


async def _intake(system: System, bid: str) -> list[tuple[int, str, dict[str, str]]]:
    """(seq, subject, headers) of each create of ``bid`` that ``AIOS_INTAKE`` stored."""
    js = system.client.bus.js
    out = []
    for subject in (f"aios.block.{bid}.create", f"aios.tenant.*.block.{bid}.create"):
        sub = await js.subscribe(subject, stream=subjects.STREAM_INTAKE, ordered_consumer=True)
        try:
            while True:
                try:
                    m = await sub.next_msg(timeout=1)
                except nats.errors.TimeoutError:
                    break
                out.append((m.metadata.sequence.stream, m.subject, dict(m.headers or {})))
        finally:
            await sub.unsubscribe()
    return sorted(out)


async def test_a_tenant_cannot_suppress_anothers_create_by_reusing_its_msg_id(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c = system.client
    await c.add_sim_cluster("tm", nodes=2, gpus=4)
    from aios_blocks.runtime import auth

    auth.add_tenant(system.data_dir, "alpha")
    auth.add_tenant(system.data_dir, "beta")
    a, b = await login(system.data_dir, "alpha"), await login(system.data_dir, "beta")
    seen_b = Seen()
    try:
        await b.subscribe("aios.block.>", cb=seen_b.on)
        await b.flush()
        same = {**HEADERS, "Nats-Msg-Id": "my-create-1"}
        # alpha uses the id first (as a hostile tenant that guessed it would) ...
        first = await a.jetstream(timeout=10).publish("aios.block.alpha-b1.create", create("alpha-b1"), headers=same)
        assert first.stream == subjects.STREAM_INTAKE and not first.duplicate
        # ... beta's create with the same id is stored, not dropped, and learns nothing of alpha's
        mine = await b.jetstream(timeout=10).publish("aios.block.beta-b1.create", create("beta-b1"), headers=same)
        assert not mine.duplicate and mine.seq > first.seq, mine
        await seen_b.until("aios.block.beta-b1.ready")
        # beta's own retry with its id is still a repeat: the first one's PubAck, nothing stored
        again = await b.jetstream(timeout=10).publish("aios.block.beta-b1.create", create("beta-b1"), headers=same)
        assert again.duplicate and again.seq == mine.seq, again
        # and the upstream's create with that id is not dropped either
        up = await c.bus.js.publish("aios.block.up-b1.create", create("up-b1"), headers=same)
        assert not up.duplicate
        # an expectation about the whole stream (the last message anyone stored) is not passed on:
        # it would tell a tenant whether another published since
        probe = await b.jetstream(timeout=10).publish(
            "aios.block.beta-b2.create", create("beta-b2"),
            headers={**HEADERS, "Nats-Expected-Last-Sequence": "1", "Nats-Msg-Id": "probe"})
        assert not probe.duplicate and probe.seq > up.seq
        # a core publish without a reply (no PubAck read) is stored all the same
        await b.publish("aios.block.beta-b3.create", create("beta-b3"), headers={**HEADERS, "Nats-Msg-Id": "core-1"})
        await b.flush()
        await seen_b.until("aios.block.beta-b3.submitted")
    finally:
        await a.close()
        await b.close()
    stored = await _intake(system, "beta-b1")
    assert [(s, subj, h.get("Nats-Msg-Id")) for s, subj, h in stored] == [
        (mine.seq, "aios.tenant.beta.block.beta-b1.create", "tenant:beta:my-create-1")]
    assert [h.get("Nats-Msg-Id") for _, _, h in await _intake(system, "alpha-b1")] == ["tenant:alpha:my-create-1"]
    assert [h.get("Nats-Expected-Last-Sequence") for _, _, h in await _intake(system, "beta-b2")] == [None]
    block = await c.store.get_block("beta-b1")
    assert block is not None and block["gen"] == mine.seq and block["ir"]["labels"]["tenant"] == "beta"
